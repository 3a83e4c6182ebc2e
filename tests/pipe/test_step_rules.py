"""The step's rules, decided once (fastpipe.step.rules), give the same answer through every face."""

import pytest
import torch
from torch import nn

from fastpipe import DistributedPipe, Pipe
from fastpipe.step.rules import (
    check_checkpoint,
    check_chunks,
    checkpoint_predicate,
    loss_reduction,
    loss_weights,
    split_targets,
)


def model(n=4):
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])


@pytest.mark.parametrize("chunks", [0, -1, 2.0, True, "4"])
def test_chunks_are_checked_alike_by_pipe_and_the_rule(chunks):
    with pytest.raises(ValueError, match="chunks must be an int >= 1") as direct:
        check_chunks(chunks)
    with pytest.raises(ValueError) as through_pipe:
        Pipe(model(), balance=[2, 2], chunks=chunks)
    assert str(through_pipe.value) == str(direct.value)


def test_checkpoint_mode_is_checked():
    assert check_checkpoint("never") == "never"
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        check_checkpoint("sometimes")


@pytest.mark.parametrize("per_minibatch", [1, 3, 4])
def test_checkpoint_predicate(per_minibatch):
    ids = range(3 * per_minibatch)  # three mini-batches, as in a window of fit
    always = checkpoint_predicate("always", True, per_minibatch)
    except_last = checkpoint_predicate("except_last", True, per_minibatch)
    assert all(always(i) for i in ids)
    # Each mini-batch's last micro-batch keeps its graph: its backward starts at once.
    assert [except_last(i) for i in ids] == [i % per_minibatch != per_minibatch - 1 for i in ids]
    for mode in ("always", "except_last", "never"):
        assert not any(checkpoint_predicate(mode, False, per_minibatch)(i) for i in ids)  # eval(): no backward
    assert not any(checkpoint_predicate("never", True, per_minibatch)(i) for i in ids)


def test_loss_weights_follow_the_reduction():
    assert loss_weights("mean", [4, 4, 2]) == [0.4, 0.4, 0.2]
    assert loss_weights("sum", [4, 4, 2]) == [1.0, 1.0, 1.0]
    assert loss_reduction(nn.MSELoss(reduction="sum"), "train_step") == "sum"
    assert loss_reduction(lambda out, y: out.sum(), "fit") == "mean"  # no attribute: a mean
    with pytest.raises(ValueError, match="reduction='none'; fit needs 'mean' or 'sum'"):
        loss_reduction(nn.MSELoss(reduction="none"), "fit")


def test_targets_split_like_the_input():
    y = torch.arange(10.0)
    assert [t.tolist() for t in split_targets(y, 3, [4, 4, 2])] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert split_targets(None, 3, [4, 4, 2]) == [None, None, None]
    with pytest.raises(ValueError, match="target batch size 9 differs from the input's 10.*one target row"):
        split_targets(y[:9], 3, [4, 4, 2])


def test_balance_left_out_names_what_to_give():
    with pytest.raises(TypeError, match=r"Pipe needs balance=.*len\(module\) = 4.*balance=\[2, 2\].*'auto'"):
        Pipe(model())
    with pytest.raises(TypeError, match="DistributedPipe needs balance="):
        DistributedPipe(model())
