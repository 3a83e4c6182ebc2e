"""The GPU host's library versions, and whether the calls fastpipe relies on exist there.

The lent GPU host runs older libraries than CI (docs/gpu.md), so the first step of the GPU
check says which of the calls that newer releases added are present, before any test trips
over one. Each probe reads a signature or makes one tiny call; none needs a GPU, so this runs
on CPU too. Prints one line per probe and a ``JSON`` line; always exits 0 (it reports, the
tests judge).

Usage: ``python bench/gpu_probe.py``.
"""

from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Callable


def _params(fn: Callable[..., object]) -> set[str]:
    return set(inspect.signature(fn).parameters)


def _backend_abort() -> str:
    import torch.distributed as dist

    if not dist.is_available():
        return "no torch.distributed"
    from torch._C._distributed_c10d import Backend

    if hasattr(Backend, "abort"):
        return "yes"
    has_group_abort = hasattr(dist.distributed_c10d, "_abort_process_group")
    return "no (fallback _abort_process_group: " + ("yes)" if has_group_abort else "no)")


def _addmm_out_dtype() -> str:
    import torch

    # kernels/_gemm.py accumulates bf16 GEMMs in fp32 through this keyword where it exists.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.ones(2, 3, dtype=torch.bfloat16, device=device)
    acc = torch.zeros(2, 2, dtype=torch.float32, device=device)
    try:
        torch.addmm(acc, a, a.t(), out_dtype=torch.float32, out=acc)
    except (TypeError, RuntimeError) as exc:
        return f"no on {device} ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    return f"yes on {device}"


def _dcp_no_dist() -> str:
    import torch.distributed.checkpoint as dcp

    found = {name: "no_dist" in _params(getattr(dcp, name)) for name in ("save", "async_save", "load")}
    return "yes" if all(found.values()) else "missing in " + ", ".join(k for k, v in found.items() if not v)


def _writer_overwrite() -> str:
    import torch.distributed.checkpoint as dcp

    return "yes" if "overwrite" in _params(dcp.FileSystemWriter.__init__) else "no"


def _create_causal_mask() -> str:
    from transformers.masking_utils import create_causal_mask

    return "(" + ", ".join(sorted(_params(create_causal_mask))) + ")"


PROBES: dict[str, Callable[[], str]] = {
    "Backend.abort": _backend_abort,
    "addmm(out_dtype=)": _addmm_out_dtype,
    "dcp save/async_save/load(no_dist=)": _dcp_no_dist,
    "FileSystemWriter(overwrite=)": _writer_overwrite,
    "transformers create_causal_mask": _create_causal_mask,
}


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for name in ("torch", "triton", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001 - a missing library is a finding, not a failure
            out[name] = f"missing ({type(exc).__name__})"
    import torch

    out["cuda"] = str(torch.version.cuda)
    return out


def main() -> int:
    found = versions()
    for name, value in found.items():
        print(f"{name:<36} {value}")
    probes: dict[str, str] = {}
    for name, probe in PROBES.items():
        try:
            probes[name] = probe()
        except Exception as exc:  # noqa: BLE001 - an absent module or attribute is what we probe for
            probes[name] = f"no ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})"
        print(f"{name:<36} {probes[name]}")
    print("JSON " + json.dumps({"versions": found, "probes": probes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
