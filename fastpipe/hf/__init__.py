"""HuggingFace models on fastpipe: :func:`to_sequential` and :data:`causal_lm_loss`.

Three lines pipeline a HF causal LM, its tied embeddings and its padding mask included::

    seq = fastpipe.hf.to_sequential(model)                       # shares model's parameters
    pipe = fastpipe.Pipe(seq, balance=[3, 3], chunks=4)
    loss = pipe.train_step(ids, labels, fastpipe.hf.causal_lm_loss, attention_mask=mask)

``loss`` equals ``model(ids, attention_mask=mask, labels=labels).loss`` and the gradients
land on ``model``'s parameters. Needs ``transformers``: ``pip install ".[hf]"`` in a fastpipe checkout.
"""

from __future__ import annotations

try:
    import transformers  # noqa: F401 - fail here, with the remedy, rather than deep in an import
except ImportError as exc:  # pragma: no cover - exercised where transformers is absent
    raise ImportError(
        'fastpipe.hf needs transformers: run pip install ".[hf]" in your fastpipe checkout (the package named '
        "fastpipe on the public index is another project)"
    ) from exc

from fastpipe.hf.adapter import to_sequential
from fastpipe.hf.errors import UnsupportedModelError
from fastpipe.hf.loss import causal_lm_loss

__all__ = ["to_sequential", "causal_lm_loss", "UnsupportedModelError"]
