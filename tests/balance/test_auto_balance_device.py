"""balance="auto" measures layers on the device the stages will run on, one layer at a time."""

import torch
from torch import nn

import fastpipe.balance as balance
import fastpipe.balance.auto as auto
from fastpipe.balance import profile_layers


class Moved(nn.Linear):
    """Records the moves asked of it; stays put (a CPU host has no second device)."""

    def __init__(self, n):
        super().__init__(n, n)
        self.moves = []
        self.grad_during = []

    def to(self, *args, **kwargs):
        self.moves.append(torch.device(args[0]))
        return self

    def forward(self, x):
        self.grad_during.append(self.weight.grad)
        return x * 2  # on the target device (meta here), like the real layer would be


def test_each_layer_visits_the_target_and_goes_home_with_its_grad():
    model = nn.Sequential(Moved(4), nn.ReLU(), Moved(4))
    kept = torch.ones(4, 4)
    model[0].weight.grad = kept
    profile = profile_layers(model, torch.randn(3, 4), repeats=2, on="meta")
    assert len(profile.forward) == 3
    for layer in (model[0], model[2]):
        # There and back for each run: one a pass, more where the system interrupted a run.
        runs = len(layer.grad_during)
        assert runs >= 3 and layer.moves == [torch.device("meta"), torch.device("cpu")] * runs
        assert all(g is None for g in layer.grad_during)  # its .grad did not travel
    assert model[0].weight.grad is kept and model[2].weight.grad is None


def test_auto_balance_profiles_on_the_first_stage_device(monkeypatch):
    seen = {}
    real = auto.profile_layers

    def spy(*args, on=None, **kwargs):
        seen["on"] = on
        return real(*args, on=on, **kwargs)

    monkeypatch.setattr(auto, "profile_layers", spy)  # where auto_balance looks it up
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Tanh())
    out = balance.auto_balance(model, ["cpu", "cpu"], torch.randn(8, 4), chunks=2)
    assert sum(out) == 4 and seen["on"] == torch.device("cpu")
