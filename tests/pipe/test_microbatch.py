import warnings

import pytest
import torch

from fastpipe.step import microbatch
from fastpipe.step.microbatch import gather, scatter


def test_even_split():
    parts = scatter(torch.arange(12).view(12, 1), 4)
    assert [p.size(0) for p in parts] == [3, 3, 3, 3]
    assert torch.equal(gather(parts), torch.arange(12).view(12, 1))


def test_uneven_split_has_smaller_last():
    parts = scatter(torch.arange(10), 3)
    assert [p.size(0) for p in parts] == [4, 4, 2]


def test_small_batch_runs_with_fewer_and_warns_once():
    microbatch._warned.clear()
    with pytest.warns(UserWarning, match="splits into 3 micro-batches"):
        parts = scatter(torch.arange(3), 8)
    assert [p.size(0) for p in parts] == [1, 1, 1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scatter(torch.arange(3), 8)  # the same shape again: silent


def test_tuple_split_keeps_non_tensors():
    parts = scatter((torch.zeros(4, 2), "tag", None, torch.ones(4)), 2)
    assert len(parts) == 2 and parts[0][1] == "tag" and parts[0][2] is None
    back = gather(parts)
    assert back[1] == "tag" and back[0].shape == (4, 2) and back[3].shape == (4,)


def test_integer_tensors_split():
    parts = scatter(torch.randint(0, 9, (6, 3)), 3)
    assert all(p.dtype == torch.int64 for p in parts)


@pytest.mark.parametrize("bad", [[torch.zeros(2)], {"x": torch.zeros(2)}, 3.0, ("a", 1)])
def test_bad_inputs_raise_type_error(bad):
    with pytest.raises(TypeError, match="Tensor or a tuple|holds no tensor"):
        scatter(bad, 2)


def test_mismatched_batch_sizes():
    with pytest.raises(ValueError, match="disagree on the batch size"):
        scatter((torch.zeros(4), torch.zeros(5)), 2)


def test_zero_dim_and_empty():
    with pytest.raises(ValueError, match="0-d tensor"):
        scatter(torch.tensor(1.0), 2)
    with pytest.raises(ValueError, match="empty"):
        scatter(torch.zeros(0, 3), 2)
