"""Every rotary type HF offers trains through ``Pipe``, including those that rewrite ``inv_freq`` as they run.

"dynamic" grows its frequencies once a sequence is longer than ``max_position_embeddings``,
and "longrope" copies its long or short factors into ``inv_freq`` on every call. The
sequences here (8 tokens) are longer than the model's 4 positions, so both rewrite. Each
pipeline layer has its own rotary, so those writes stay inside one stage.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from _hf_models import batch, grads_by_name, reduction_length, reference_step, tiny  # noqa: E402
from fp_tolerance import assert_close_reordered  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

import fastpipe  # noqa: E402
from fastpipe.hf import causal_lm_loss, to_sequential  # noqa: E402

POSITIONS = 4  # max_position_embeddings, and the pretraining length of the scaled types
HALF = 4  # head_dim // 2: one factor per frequency
SETTINGS = {
    "default": {},
    "linear": {"factor": 2.0},
    "dynamic": {"factor": 2.0},
    "yarn": {"factor": 2.0, "original_max_position_embeddings": POSITIONS},
    "longrope": {
        "short_factor": [1.0] * HALF,
        "long_factor": [1.0 + i for i in range(HALF)],
        "original_max_position_embeddings": POSITIONS,
    },
    "llama3": {"factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 2},
    "proportional": {"partial_rotary_factor": 0.5},
}
# Phi-3's config accepts these rope types only.
PHI3_TYPES = ("default", "longrope")


def test_every_rope_type_of_this_transformers_has_settings_here() -> None:
    missing = sorted(set(ROPE_INIT_FUNCTIONS) - set(SETTINGS))
    assert not missing, f"transformers offers rope types {missing}: add their rope_parameters to SETTINGS"


def _check(family: str, rope_type: str) -> None:
    rope = {"rope_type": rope_type, "rope_theta": 10000.0, **SETTINGS[rope_type]}
    model = tiny(family, attn="eager", rope_parameters=rope, max_position_embeddings=POSITIONS)
    ids, mask, labels = batch()
    pipe = fastpipe.Pipe(to_sequential(model), balance=[3, 4], chunks=2, checkpoint="except_last")
    for _ in range(2):  # the second step finds the rotaries as the first left them
        model.zero_grad()
        ref_loss, ref_grads = reference_step(model, ids, mask, labels)
        loss = pipe.train_step(ids, labels, causal_lm_loss, attention_mask=mask)
        assert_close_reordered(loss.detach(), ref_loss, k=reduction_length())
        grads = grads_by_name(model)
        for name, grad in ref_grads.items():
            assert_close_reordered(grads[name], grad, k=reduction_length("grad"), msg=name)


@pytest.mark.parametrize("rope_type", ["default", *sorted(ROPE_INIT_FUNCTIONS)])
def test_llama_trains_through_the_pipe_under_every_rope_type(rope_type: str) -> None:
    _check("llama", rope_type)


@pytest.mark.parametrize("rope_type", PHI3_TYPES)
def test_phi3_trains_through_the_pipe_under_every_rope_type_it_accepts(rope_type: str) -> None:
    _check("phi3", rope_type)


def test_the_check_before_anything_runs_leaves_every_rotary_as_the_model_had_it() -> None:
    """to_sequential probes the forward on 4 tokens; a dynamic rotary must not keep frequencies grown for them."""
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, **SETTINGS["dynamic"]}
    model = tiny("llama", rope_parameters=rope, max_position_embeddings=2)
    rotaries = [layer.rotary_emb for layer in to_sequential(model)[:-1]]
    assert len(rotaries) == 6  # the embedding, 4 blocks, the final norm
    for rotary in rotaries:
        assert rotary.max_seq_len_cached == 2
        assert torch.equal(rotary.inv_freq, model.model.rotary_emb.inv_freq)
