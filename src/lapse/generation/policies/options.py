"""The command line's policy flags, shared by ``lapse generate`` and every ``lapse eval``
that runs under a policy: one dataclass that the commands' configs derive from, so the
flags, their help and the policy they build are written once."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Annotated, Literal

import tyro

if TYPE_CHECKING:  # the policies import torch; make_policy imports them when it runs
    from .base import Policy

PolicyName = Literal["dense", "window", "acp", "h2o", "a2sf", "dcp"]


USES = {
    "dense": ("every",),
    "window": ("sinks", "window", "every"),
    "acp": ("eps", "every"),
    "h2o": ("budget", "recent", "sinks", "per", "every"),
    "a2sf": ("budget", "recent", "alpha", "sinks", "per", "every"),
    "dcp": ("every",),
}
"""The flags each policy takes (the others are refused when given)."""

SETS = {
    "budget": "the tokens kept per head",
    "recent": "the recent positions always kept",
    "alpha": "the forgetting factor of the accumulated scores",
    "per": "whether tokens are ranked per kv head or per layer",
    "sinks": "the first positions always kept",
    "window": "the recent positions kept",
    "eps": "the attention mass a row may lose",
    "every": "the steps between eviction passes",
}
"""What each policy flag sets, for the error that refuses it where it does nothing."""

DEFAULTS = {"budget": 0.2, "recent": 32, "alpha": 0.9, "per": "head", "sinks": 4, "window": 1024,
            "eps": math.exp(-10)}
"""The policy flags' values where they are not given (``every``: the policy's own)."""


def _given(metavar: str, default: str, **kwargs):
    """A policy field's flag: ``None`` until given (so that one given to a policy that does not
    read it is refused), its help naming the value it stands for (:data:`DEFAULTS`)."""
    return tyro.conf.arg(metavar=metavar, help_behavior_hint=f"(default: {default})", **kwargs)


@dataclass(kw_only=True)
class PolicyOptions:
    """An eviction policy and its fields, as flags (``--policy h2o --budget 64 ...``)."""

    policy: PolicyName | None = None
    """Eviction policy: keep everything; sinks + window; ACP boundary (FoX Pro); H2O; A2SF;
    DCP (free what a DCP model's interaction mask dropped). ``None``: no policy (the
    command's plain path)."""
    budget: Annotated[float | None, _given("FLOAT", "0.2")] = None
    """h2o / a2sf: tokens kept per head, a share of the prompt if <= 1, else a count."""
    recent: Annotated[int | None, _given("INT", "32")] = None
    """h2o / a2sf: recent positions always kept."""
    alpha: Annotated[float | None, _given("FLOAT", "0.9")] = None
    """a2sf: forgetting factor of the accumulated scores."""
    per: Annotated[Literal["head", "layer"] | None, _given("{head,layer}", "head")] = None
    """h2o / a2sf: rank tokens per kv head, or once per layer (every head the same tokens:
    what DCP models need)."""
    sinks: Annotated[int | None, _given("INT", "4")] = None
    """window / h2o / a2sf: first positions always kept (attention sinks). 4 for every policy
    here; the ``H2O`` and ``A2SF`` classes default to 0, as their papers keep none."""
    window: Annotated[int | None, _given("INT", "1024")] = None
    """window: recent positions kept."""
    eps: Annotated[float | None, _given("FLOAT", "e^-10", aliases=("--acp-eps",))] = None
    """acp: attention mass a row may lose to eviction."""
    every: int | None = None
    """Evict every this many steps (outside the decode step); default: the policy's own
    (window, acp: 64; h2o, a2sf: 1; dcp: 128)."""

    def __post_init__(self) -> None:
        # a flag the policy does not read would run as if it were not given: `--policy acp
        # --window 8` keeps what acp keeps. The fields are None unless given, so a flag typed
        # at its default value is refused too, and one left out never is.
        unused = [f.name for f in fields(PolicyOptions)
                  if f.name != "policy" and f.name not in USES.get(self.policy, ())
                  and getattr(self, f.name) is not None]
        if unused:
            raise ValueError(unused_flags(unused, "without --policy" if self.policy is None
                                          else f"by --policy {self.policy}", USES))
        budget = self.value("budget")
        if not budget > 0:
            raise ValueError(f"--budget must be positive (a share of the prompt or a count), got {budget}")
        if budget > 1 and budget != int(budget):  # it was cut to the integer below
            raise ValueError(
                f"--budget above 1 counts tokens: give an integer, or a share up to 1, got {budget}"
            )
        self.make_policy()  # bad policy fields fail here, before any model loads

    def value(self, name: str):
        """Field ``name`` as given, else its default (:data:`DEFAULTS`)."""
        given = getattr(self, name)
        return DEFAULTS[name] if given is None else given

    def make_policy(self) -> Policy | None:
        """The policy the flags name (``None`` without ``--policy``)."""
        from .registry import A2SF, H2O, ACPBoundary, DCPDrop, Dense, SinkWindow

        v = self.value
        budget = int(v("budget")) if v("budget") > 1 else float(v("budget"))
        every = {} if self.every is None else {"every": self.every}
        match self.policy:
            case None:
                return None
            case "dense":
                return Dense(**every)
            case "window":
                return SinkWindow(sinks=v("sinks"), window=v("window"), **every)
            case "acp":
                return ACPBoundary(eps=v("eps"), **every)
            case "h2o":
                return H2O(budget=budget, recent=v("recent"), sinks=v("sinks"), per=v("per"), **every)
            case "a2sf":
                return A2SF(budget=budget, recent=v("recent"), alpha=v("alpha"), sinks=v("sinks"),
                            per=v("per"), **every)
            case "dcp":
                return DCPDrop(**every)
        raise ValueError(f"--policy must be one of dense, window, acp, h2o, a2sf, dcp; got {self.policy!r}")


def unused_flags(
    names: list[str], where: str, uses: dict[str, tuple[str, ...]], option: str = "--policy"
) -> str:
    """One line refusing the flags ``names`` that ``where`` (``"by --policy acp"``) does not
    use, each with what it sets and the policies of ``uses`` that read it (named as values of
    ``option``)."""
    def sets(name: str) -> str:
        readers = [p for p, flags in uses.items() if name in flags]
        listed = readers[0] if len(readers) == 1 else f"{', '.join(readers[:-1])} or {readers[-1]}"
        return f"{SETS[name]} ({option} {listed})"

    if len(names) == 1:
        return f"--{names[0]} is not used {where}; it sets {sets(names[0])}"
    listed = ", ".join(f"--{n}" for n in names[:-1]) + f" and --{names[-1]}"
    return f"{listed} are not used {where}; " + "; ".join(f"--{n} sets {sets(n)}" for n in names)
