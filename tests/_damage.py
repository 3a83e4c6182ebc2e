"""Damage a ``torch.save`` file the way a bad disk does, where ``torch.load`` cannot see it."""

from __future__ import annotations

import struct
import zipfile

__all__ = ["flip_tensor_bytes"]

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip member's local header, before its name and extra field


def flip_tensor_bytes(path: str) -> int:
    """Flips one bit in the middle of every tensor record of the file; returns how many it flipped.

    Only the tensors' bytes change, not the zip's headers, and ``torch.load`` does not check
    the members' CRCs: the file still loads, with other weights.
    """
    with zipfile.ZipFile(path) as archive:
        members = [m for m in archive.infolist() if "/data/" in m.filename and m.file_size > 0]
    with open(path, "rb") as f:
        data = bytearray(f.read())
    for member in members:
        header = _LOCAL_HEADER.unpack_from(data, member.header_offset)
        name_length, extra_length = header[-2], header[-1]
        start = member.header_offset + _LOCAL_HEADER.size + name_length + extra_length
        data[start + member.file_size // 2] ^= 0x01
    with open(path, "wb") as f:
        f.write(bytes(data))
    return len(members)
