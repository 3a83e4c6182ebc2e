"""What ``Pipe(checkpoint=...)`` recomputes in the backward: whole stages, or chosen layers and parts.

The accepted forms (:func:`checkpoint_setting` checks them):

* ``"always"``, ``"except_last"``, ``"never"``: whole stages, per micro-batch
  (:func:`fastpipe.step.rules.checkpoint_predicate`);
* a predicate ``fn(index, layer) -> bool`` over the Sequential's layers (global index): those
  layers are recomputed, the others keep what they save;
* ``"attention"``, ``"mlp"``, or a list of them: that part of every decoder block
  (a layer that names its parts with a ``fastpipe_parts()`` method, as the blocks of
  :func:`fastpipe.hf.to_sequential` do);
* ``"auto"``: the cheapest of :func:`auto_candidates` whose predicted peak fits ``memory_limit``
  (:mod:`fastpipe.memory.recompute`); "never" without a limit;
* a :class:`Recompute` (either of the two above, with a name for messages).

A per-layer policy keeps each stage's graph and recomputes only its regions
(:mod:`fastpipe.runtime.selective` runs them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from fastpipe.model.skips import Stash, has_skips

__all__ = [
    "PARTS",
    "PARTS_METHOD",
    "CheckpointSetting",
    "LayerPredicate",
    "Recompute",
    "auto_candidates",
    "checkpoint_setting",
    "every_layer",
    "every_other_layer",
    "layer_parts",
    "missing_parts",
    "stage_mode",
]

#: The parts of a decoder block that ``checkpoint=`` can name.
PARTS = ("attention", "mlp")
#: The method of a layer that returns its parts by name (``{"attention": module, "mlp": module}``).
PARTS_METHOD = "fastpipe_parts"
_WHOLE_STAGE = ("always", "except_last", "never")

LayerPredicate = Callable[[int, nn.Module], bool]

_FORMS = (
    "'always', 'except_last', 'never' (whole stages), 'auto' (the cheapest that fits memory_limit), "
    "'attention' or 'mlp' or a list of them (those parts of every decoder block), a predicate "
    "fn(index, layer) -> bool (those layers of the Sequential), or a fastpipe.step.recompute_policy.Recompute"
)


@dataclass(frozen=True)
class Recompute:
    """A per-layer recompute policy.

    Attributes:
        layers: ``fn(index, layer) -> bool``: recompute the layers of the Sequential it
            selects (``index`` counts from 0 over the whole Sequential).
        parts: names from :data:`PARTS`: recompute that part of every layer that has it.
        name: how the policy shows in messages and logs.
        first: the index in the Sequential of the first layer :meth:`regions` is given (a rank's
            stages start where the stages of the ranks before end).
        whole: whether :meth:`regions` sees the whole model, so that a named part no layer has is
            refused there; a rank sees its own stages only, and the ranks check together.
        stage: ``"never"``: each stage keeps its graph but for the regions; ``"always"``: each
            stage also keeps only its input per micro-batch and replays its forward in the
            backward, where the regions recompute again, one at a time. The forward then runs
            three times, and a micro-batch in flight holds the least it can.
    """

    layers: LayerPredicate | None = None
    parts: tuple[str, ...] = ()
    name: str = ""
    first: int = 0
    whole: bool = True
    stage: Literal["never", "always"] = "never"

    def __post_init__(self) -> None:
        if self.layers is None and not self.parts:
            raise ValueError(f"fastpipe: a Recompute needs layers= (a predicate) or parts= (from {PARTS})")
        if self.layers is not None and not callable(self.layers):
            raise ValueError(f"fastpipe: Recompute(layers=) takes fn(index, layer) -> bool, got {self.layers!r}")
        if self.stage not in ("never", "always"):
            raise ValueError(f"fastpipe: Recompute(stage=) takes 'never' or 'always', got {self.stage!r}")
        unknown = [p for p in self.parts if p not in PARTS]
        if unknown or len(set(self.parts)) != len(self.parts):
            raise ValueError(f"fastpipe: Recompute(parts=) takes distinct names from {PARTS}, got {self.parts!r}")

    def __str__(self) -> str:
        if self.name:
            return self.name
        what = [*self.parts, *(["layers " + getattr(self.layers, "__name__", "chosen")] if self.layers else [])]
        return " + ".join(what) + (" inside stage recompute" if self.stage == "always" else "")

    @property
    def regions_key(self) -> tuple[Any, ...]:
        """What the regions depend on: two policies with one key recompute the same modules."""
        return (self.layers, self.parts, self.first, self.whole)

    def regions(self, stages: Sequence[nn.Module]) -> list[list[nn.Module]]:
        """The modules each stage recomputes, for the stages of a pipe in order.

        Raises:
            ValueError: a named part that no layer has (naming the parts there are), a predicate
                that does not answer with a bool, or a region that stashes skips.
        """
        found: list[list[nn.Module]] = []
        offered: dict[str, int] = {}
        index = self.first
        for stage in stages:
            chosen: list[nn.Module] = []
            for layer in stage.children():
                parts = layer_parts(layer)
                for name in parts:
                    offered[name] = offered.get(name, 0) + 1
                if self.layers is not None and _answer(self.layers, index, layer):
                    chosen.append(layer)
                else:
                    chosen += [parts[p] for p in self.parts if p in parts]
                index += 1
            found.append([_checked(region) for region in chosen])
        missing = [p for p in self.parts if p not in offered]
        if missing and self.whole:
            raise ValueError(missing_parts(missing, offered))
        return found

    def at(self, first: int) -> Recompute:
        """This policy over stages whose first layer is layer ``first`` of the Sequential, and not all of it."""
        return dataclasses.replace(self, first=first, whole=False)


CheckpointSetting = (
    Literal["always", "except_last", "never", "auto", "attention", "mlp"] | Sequence[str] | LayerPredicate | Recompute
)


def checkpoint_setting(value: object) -> str | Recompute:
    """``checkpoint=`` as the pipe keeps it: a whole-stage mode or ``"auto"``, or a :class:`Recompute`.

    Raises:
        ValueError: anything else, listing the accepted forms.
    """
    if isinstance(value, Recompute):
        return value
    if isinstance(value, str):
        if value in (*_WHOLE_STAGE, "auto"):
            return value
        if value in PARTS:
            return Recompute(parts=(value,), name=value)
        raise ValueError(f"fastpipe: checkpoint must be one of the accepted forms, {_FORMS}; got {value!r}")
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v in PARTS for v in value):
        if len(set(value)) != len(value):
            raise ValueError(f"fastpipe: checkpoint={value!r} names a part twice; name each of {PARTS} once")
        return Recompute(parts=tuple(value), name=" + ".join(value))
    if callable(value) and not isinstance(value, nn.Module):
        return Recompute(layers=value)
    raise ValueError(f"fastpipe: checkpoint must be one of the accepted forms, {_FORMS}; got {value!r}")


def stage_mode(setting: object) -> Literal["always", "except_last", "never"]:
    """The whole-stage mode that ``setting`` runs: a :class:`Recompute`'s ``stage``, a whole-stage
    name itself, else ``"never"`` (``"auto"`` before its choice: the most it can hold)."""
    if isinstance(setting, Recompute):
        return setting.stage
    return setting if setting in _WHOLE_STAGE else "never"  # type: ignore[return-value]


def every_other_layer(index: int, layer: nn.Module) -> bool:
    """The odd layers of the Sequential: a transformer's embedding (layer 0) keeps its activations."""
    return index % 2 == 1


def every_layer(index: int, layer: nn.Module) -> bool:
    """Every layer, each its own region: a micro-batch in flight keeps each layer's input, and its
    backward rebuilds one layer at a time (``"always"`` keeps the stage's input and rebuilds the stage)."""
    return True


def auto_candidates(stages: Sequence[nn.Module]) -> list[str | Recompute]:
    """What ``checkpoint="auto"`` tries, from the least recompute to the most.

    ``"never"``; the parts the layers have (``"mlp"``, ``"attention"``); every other layer;
    both parts; ``"except_last"``; every layer; ``"always"``; every layer inside ``"always"``.
    Every layer and ``"always"`` both recompute the whole forward once; neither holds less in
    every case (the one keeps each layer's input per micro-batch in flight, the other a whole
    stage's activation while it rebuilds it), so both are tried. The last recomputes it twice
    and holds the least of all: a stage's input per micro-batch in flight, and while one
    rebuilds, its layers' inputs and one layer's activation.
    """
    layers = [layer for stage in stages for layer in stage.children()]
    offered = {name for layer in layers for name in layer_parts(layer)}
    found: list[str | Recompute] = ["never"]
    found += [Recompute(parts=(p,), name=p) for p in ("mlp", "attention") if p in offered]
    if len(layers) > 1 and all(_checked_quietly(layer) for i, layer in enumerate(layers) if i % 2):
        found.append(Recompute(layers=every_other_layer, name="every other layer"))
    if set(PARTS) <= offered:
        found.append(Recompute(parts=PARTS, name=" + ".join(PARTS)))
    found.append("except_last")
    if len(layers) > 1 and all(_checked_quietly(layer) for layer in layers):
        every = Recompute(layers=every_layer, name="every layer")
        return [*found, every, "always", dataclasses.replace(every, stage="always", name="always, then every layer")]
    return [*found, "always"]


def layer_parts(layer: nn.Module) -> Mapping[str, nn.Module]:
    """The parts ``layer`` names (its ``fastpipe_parts()``), or none."""
    method = getattr(layer, PARTS_METHOD, None)
    if method is None:
        return {}
    parts = method()
    return {name: module for name, module in parts.items() if name in PARTS and isinstance(module, nn.Module)}


def _answer(predicate: LayerPredicate, index: int, layer: nn.Module) -> bool:
    answer: Any = predicate(index, layer)
    if not isinstance(answer, bool):
        raise ValueError(
            f"fastpipe: the checkpoint predicate returned {answer!r} for layer {index} ({type(layer).__name__}); "
            "it must return True (recompute the layer) or False"
        )
    return answer


def _checked(region: nn.Module) -> nn.Module:
    if not _checked_quietly(region):
        raise ValueError(
            f"fastpipe: {type(region).__name__} stashes a skip (fastpipe.stash), which a recompute would stash "
            "again; leave it out of the checkpoint predicate, or recompute whole stages (checkpoint='always')"
        )
    return region


def _checked_quietly(region: nn.Module) -> bool:
    return not isinstance(region, Stash) and not has_skips(region)


def missing_parts(missing: list[str], offered: Mapping[str, int]) -> str:
    """Why named parts ``missing`` cannot be recomputed, given the parts ``offered`` (layers per name)."""
    asked = missing[0] if len(missing) == 1 else missing
    if not offered:
        return (
            f"fastpipe: checkpoint={asked!r} recomputes a named part of decoder blocks, and no layer of this model "
            f"names its parts (the blocks of fastpipe.hf.to_sequential do: {', '.join(PARTS)}; a layer of your own "
            f"can, with a {PARTS_METHOD}() method). Pass a predicate fn(index, layer) -> bool to choose layers instead"
        )
    there = ", ".join(f"{name!r} ({count} layers)" for name, count in offered.items())
    return f"fastpipe: checkpoint={asked!r} matches no part of this model's layers; the parts there are: {there}"
