"""Skip connections across stages: a layer stashes a tensor, a later layer pops it.

A U-Net's decoder reads the encoder's features, a long residual adds a tensor from many
layers back. In an ``nn.Sequential`` such a tensor would have to ride along as a tuple item
through every layer in between (and, in a pipeline, through every stage in between). Instead,
name it where it is made and where it is used::

    model = fastpipe.Sequential(
        down1, fastpipe.stash("d1"),          # records its input under "d1", passes it on
        down2, fastpipe.stash("d2"),
        middle,
        fastpipe.pops(Up(), "d2"),            # called as up(x, d2=...)
        fastpipe.pops(Up(), "d1"),
        head,
    )
    model(x)                                  # the plain model
    fastpipe.Pipe(model, balance=[3, 2, 3], chunks=4)(x)  # the same, pipelined

or, for a class of your own, with a class attribute ``fastpipe_pops = ("d1",)``.

In a :class:`fastpipe.Pipe` (and :class:`fastpipe.DistributedPipe`) the stashed tensor goes
straight from the stage that stashes it to the stage that pops it, not through the stages
between. The consumer receives it as a leaf that requires grad; its backward sends the
gradient straight back, and the producer's backward adds it to the gradient of whatever
made the tensor. Under checkpointing a recomputed producer stashes again, and a recomputed
consumer pops the tensor it received. Within one stage a stash and its pop are a local value.

The rules, checked when the pipe is built (and by :func:`check_skips`): each name is stashed
by one layer and popped by one later layer; a stash is a layer of the Sequential (or of a
nested ``nn.Sequential``), not a module inside another layer's forward; a stash records a
tensor. To feed two consumers, stash the tensor twice under two names.

The memory plan counts skips through :mod:`fastpipe.model.skip_memory`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from torch import Tensor, nn

__all__ = [
    "POPS_ATTRIBUTE",
    "Stash",
    "SkipEvent",
    "SkipStore",
    "StageSkips",
    "stash",
    "pops",
    "popped",
    "has_skips",
    "skip_events",
    "plan_skips",
    "check_skips",
    "open_skips",
]

POPS_ATTRIBUTE = "fastpipe_pops"

M = TypeVar("M", bound=nn.Module)


class Stash(nn.Module):
    """A layer that records its input under :attr:`name` and returns it unchanged (see :func:`stash`).

    Called on its own (outside :class:`fastpipe.Sequential` or a pipe) it is the identity.
    """

    def __init__(self, name: str) -> None:
        super().__init__()
        _check_name(name, "fastpipe.stash")
        self.name = name

    def forward(self, input: Tensor) -> Tensor:  # noqa: D102 - the class says it
        return input

    def extra_repr(self) -> str:
        return repr(self.name)


def stash(name: str) -> Stash:
    """A layer that stashes its input under ``name`` for a later layer that :func:`pops` it."""
    return Stash(name)


def pops(layer: M, *names: str) -> M:
    """Declare that ``layer`` takes the tensors stashed under ``names`` as keyword arguments; returns ``layer``.

    The names add to those the layer (or its class, through ``fastpipe_pops``) already declares.

    Raises:
        TypeError: ``layer`` is not a module, or a name is not an identifier.
    """
    if not isinstance(layer, nn.Module):
        raise TypeError(f"fastpipe.pops: expected an nn.Module, got {type(layer).__name__}")
    for name in names:
        _check_name(name, "fastpipe.pops")
    own = popped(layer)
    setattr(layer, POPS_ATTRIBUTE, own + tuple(n for n in names if n not in own))
    return layer


def popped(layer: nn.Module) -> tuple[str, ...]:
    """The names ``layer`` pops (its own declaration; a nested Sequential's layers declare their own)."""
    return tuple(getattr(layer, POPS_ATTRIBUTE, ()))


def _check_name(name: object, where: str) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise TypeError(f"{where}: a skip's name is a keyword argument name, got {name!r}")


def _runs_inside(layer: nn.Module) -> bool:
    """Whether a runner walks into ``layer`` layer by layer (a plain nested ``nn.Sequential``)."""
    return isinstance(layer, nn.Sequential) and not popped(layer)


def has_skips(module: nn.Module) -> bool:
    """Whether ``module`` (a Sequential, walked as the runner walks it) stashes or pops anything."""
    for layer in module._modules.values():
        if layer is None:
            continue
        if isinstance(layer, Stash) or popped(layer) or (_runs_inside(layer) and has_skips(layer)):
            return True
    return False


@dataclass(frozen=True)
class SkipEvent:
    """A stash or a pop of ``name`` by the layer at path ``layer`` (names in the Sequential)."""

    kind: Literal["stash", "pop"]
    name: str
    layer: str


def skip_events(module: nn.Module, prefix: str = "") -> list[SkipEvent]:
    """The stashes and pops of ``module``'s layers in the order they run.

    Raises:
        ValueError: a stash or a pop declaration sits inside a layer whose forward runs
            it, where no runner can see it.
    """
    events: list[SkipEvent] = []
    for name, layer in module._modules.items():
        if layer is None:
            continue
        path = f"{prefix}{name}"
        if isinstance(layer, Stash):
            events.append(SkipEvent("stash", layer.name, path))
            continue
        events += [SkipEvent("pop", n, path) for n in popped(layer)]
        if _runs_inside(layer):
            events += skip_events(layer, f"{path}.")
            continue
        for sub, inner in _submodules(layer):
            what = f"fastpipe.stash({inner.name!r})" if isinstance(inner, Stash) else f"a pop of {popped(inner)}"
            raise ValueError(
                f"fastpipe: {what} sits at {path}.{sub}, inside layer {path!r}, whose own forward calls it; "
                "skips are layers of the Sequential (or of a nested nn.Sequential) so that the pipeline sees them. "
                f"Make it a layer of its own next to {path!r}, or declare the pop on {path!r} itself"
            )
    return events


def _submodules(layer: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for sub, inner in layer.named_modules(remove_duplicate=False):
        if sub and (isinstance(inner, Stash) or popped(inner)):
            yield sub, inner


@dataclass(frozen=True)
class StageSkips:
    """What one stage of a pipeline does with skips.

    Attributes:
        layers: the stage has stash or pop layers (its run needs a :class:`SkipStore`).
        sends: per consumer stage, the names this stage stashes and that stage pops, in stash order.
        receives: per producer stage, the names that stage stashes and this stage pops.
    """

    layers: bool = False
    sends: tuple[tuple[int, tuple[str, ...]], ...] = ()
    receives: tuple[tuple[int, tuple[str, ...]], ...] = ()


def plan_skips(stages: Sequence[Sequence[SkipEvent]]) -> list[StageSkips]:
    """Check the skips of a whole model (its stages' events, in order) and route them between stages.

    Raises:
        ValueError: a name stashed twice or popped twice, a pop with no earlier stash, or a
            stash that nothing pops; the message names the layers.
    """
    stashed: dict[str, tuple[int, str]] = {}
    taken: dict[str, tuple[int, str]] = {}
    later = {e.name: e.layer for events in stages for e in events if e.kind == "stash"}
    for s, events in enumerate(stages):
        for e in events:
            if e.kind == "stash":
                if e.name in stashed:
                    raise ValueError(
                        f"fastpipe: {e.name!r} is stashed twice (layers {stashed[e.name][1]!r} and {e.layer!r}); "
                        "give each fastpipe.stash its own name"
                    )
                stashed[e.name] = (s, e.layer)
            elif e.name in taken:
                raise ValueError(
                    f"fastpipe: {e.name!r} is popped twice (layers {taken[e.name][1]!r} and {e.layer!r}); a stash "
                    f"feeds one pop: stash the tensor twice under two names (fastpipe.stash({e.name!r}), "
                    f"fastpipe.stash({e.name + '_2'!r})) and pop one each"
                )
            elif e.name not in stashed:
                where = f"layer {later[e.name]!r} stashes it only after" if e.name in later else "no layer stashes it"
                raise ValueError(
                    f"fastpipe: layer {e.layer!r} pops {e.name!r}, but {where}; put fastpipe.stash({e.name!r}) "
                    "at an earlier place in the Sequential"
                )
            else:
                taken[e.name] = (s, e.layer)
    unused = [n for n in stashed if n not in taken]
    if unused:
        raise ValueError(
            f"fastpipe: layer {stashed[unused[0]][1]!r} stashes {unused[0]!r}, but no later layer pops it; "
            f"declare the consumer with fastpipe.pops(layer, {unused[0]!r}) (or a class attribute "
            f"fastpipe_pops = ({unused[0]!r},)), or remove the stash"
        )
    sends: list[dict[int, list[str]]] = [{} for _ in stages]
    receives: list[dict[int, list[str]]] = [{} for _ in stages]
    for name, (p, _) in stashed.items():
        c = taken[name][0]
        if c != p:
            sends[p].setdefault(c, []).append(name)
            receives[c].setdefault(p, []).append(name)
    return [
        StageSkips(
            bool(events),
            tuple((c, tuple(names)) for c, names in sorted(sends[s].items())),
            tuple((p, tuple(names)) for p, names in sorted(receives[s].items())),
        )
        for s, events in enumerate(stages)
    ]


def check_skips(module: nn.Module) -> None:
    """Raise a clear error unless every pop of ``module`` has one earlier stash of its own (see the module doc)."""
    plan_skips([skip_events(module)])


class SkipStore:
    """The stashed tensors of one run of a model or of one stage's task, by name.

    Args:
        received: tensors stashed on other stages for this stage's pops.
    """

    def __init__(self, received: Mapping[str, Tensor] | None = None) -> None:
        self.values: dict[str, Tensor] = dict(received or {})
        self.received = tuple(self.values)

    def put(self, name: str, value: Any) -> None:
        """Record ``value`` under ``name`` (a :class:`Stash` layer's input)."""
        if not isinstance(value, Tensor):
            raise TypeError(
                f"fastpipe: fastpipe.stash({name!r}) received {type(value).__name__}; a stash records a Tensor "
                "(put a layer that picks the tensor to stash before it)"
            )
        if name in self.values:
            raise ValueError(f"fastpipe: {name!r} is stashed twice in one run; give each fastpipe.stash its own name")
        self.values[name] = value

    def take(self, name: str, layer: nn.Module) -> Tensor:
        """Remove and return the tensor stashed under ``name`` for ``layer``."""
        try:
            return self.values.pop(name)
        except KeyError:
            raise ValueError(
                f"fastpipe: {type(layer).__name__} pops {name!r}, but no earlier layer stashed it in this run; "
                f"put fastpipe.stash({name!r}) before it"
            ) from None

    def left(self, names: Sequence[str]) -> list[Tensor]:
        """The tensors stashed under ``names`` that no layer of this run popped (they go to other stages)."""
        missing = [n for n in names if n not in self.values]
        if missing:
            raise ValueError(f"fastpipe: the stage stashed no tensor under {missing} in this run")
        return [self.values[n] for n in names]


def open_skips(module: nn.Module) -> SkipStore | None:
    """A store for one run of a whole model, or None when it has no skips; checks them first."""
    if not has_skips(module):
        return None
    check_skips(module)
    return SkipStore()
