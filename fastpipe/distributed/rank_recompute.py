"""``DistributedPipe(checkpoint=...)`` with a per-layer policy: each rank recomputes the regions of its stages.

The forms are :class:`fastpipe.Pipe`'s (:mod:`fastpipe.step.recompute_policy`): a predicate
``fn(index, layer)`` with ``index`` in the whole model, or named parts of decoder blocks
(``"attention"``, ``"mlp"``). A rank holds only its own stages, so it resolves the policy on them
from their first layer's index in the model, and the ranks then check together that each named
part is some layer's: a stage of embeddings alone has none, and is not wrong for it. Whatever one
rank finds wrong is raised on every rank (:func:`check_regions`), so none waits on another.

The step runs the regions as ``Pipe`` does (:mod:`fastpipe.runtime.selective`), and recomputes
no whole stage; ``memory_limit`` measures each stage with its regions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fastpipe.runtime.selective import set_regions
from fastpipe.runtime.stage import Stage
from fastpipe.step.recompute_policy import Recompute, layer_parts, missing_parts

__all__ = ["check_regions", "described", "rank_regions", "stage_policy", "whole_stage"]


def stage_policy(policy: Recompute, balance: Sequence[int], s: int) -> Recompute:
    """``policy`` as stage ``s`` of a pipeline of ``balance`` takes it: counting from its first layer's index."""
    return policy.at(sum(balance[:s]))


def rank_regions(
    setting: object, stages: Mapping[int, Stage], balance: Sequence[int], error: str = ""
) -> dict[str, Any]:
    """Set ``setting``'s regions on this rank's stages (a per-layer policy; nothing for another setting).

    Args:
        setting: the pipe's ``checkpoint``.
        stages: this rank's stages, by index.
        balance: layers per stage of the whole pipeline.
        error: what else went wrong building this rank's part (its ``offload=``), to raise on every rank.

    Returns:
        What :func:`check_regions` takes from every rank: the parts this rank's layers name, and
        the error its policy raised here or ``error``, if any (the regions are then left unset).
    """
    offered: dict[str, int] = {}
    for st in stages.values():
        for layer in st.module.children():
            for name in layer_parts(layer):
                offered[name] = offered.get(name, 0) + 1
    if isinstance(setting, Recompute) and not error:
        try:
            found = {s: stage_policy(setting, balance, s).regions([st.module])[0] for s, st in stages.items()}
        except ValueError as exc:
            error = str(exc)
        else:
            for s, st in stages.items():
                set_regions(st, found[s])
    return {"offered": offered, "error": error}


def check_regions(setting: object, reports: Sequence[Mapping[str, Any]]) -> None:
    """Raise on every rank what any rank's :func:`rank_regions` found wrong, or a named part no rank's layers have.

    Raises:
        ValueError: the first rank's error, or the parts that are nowhere (naming those there are).
    """
    errors = [r["error"] for r in reports if r["error"]]
    if errors:
        raise ValueError(errors[0])
    if isinstance(setting, Recompute):
        offered: dict[str, int] = {}
        for r in reports:
            for name, count in r["offered"].items():
                offered[name] = offered.get(name, 0) + count
        missing = [p for p in setting.parts if p not in offered]
        if missing:
            raise ValueError(missing_parts(missing, offered))


def whole_stage(setting: object) -> Any:
    """The whole-stage mode a step runs under ``setting`` (a per-layer policy's own ``stage``)."""
    return setting.stage if isinstance(setting, Recompute) else setting


def described(setting: object) -> str:
    """What ranks compare of ``setting`` (a predicate is a different object on every rank)."""
    if isinstance(setting, Recompute):
        predicate = ", a layer predicate" if setting.layers else ""
        return f"per-layer: parts {list(setting.parts)}{predicate}, stage {setting.stage}"
    return str(setting)
