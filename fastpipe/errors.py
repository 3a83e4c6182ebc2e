"""Exceptions raised by fastpipe."""

from __future__ import annotations

__all__ = ["PipelineError", "annotate"]


class PipelineError(RuntimeError):
    """A pipeline could not run: a worker died, a peer vanished, or state was misused."""


def annotate(exc: BaseException, note: str) -> BaseException:
    """Attach ``note`` to ``exc`` so the caller sees where in the pipeline it was raised.

    The exception keeps its type, so ``except ValueError`` in user code still works after
    a stage raised ``ValueError``. Python 3.11 shows notes under the message; on older
    versions the note is kept on ``exc.fastpipe_note`` only.
    """
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:
        add_note(note)
    else:  # pragma: no cover - Python 3.10
        exc.fastpipe_note = note  # type: ignore[attr-defined]
    return exc
