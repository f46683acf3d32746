"""What every eviction policy is: a small frozen dataclass that, shown what a layer holds
(:class:`lapse.kv.LayerSnapshot`), returns which slots each (sequence, kv head) keeps. It
never touches memory: the store (:class:`lapse.kv.PagedStore`) frees the pages.

Eviction runs outside the decode step, every ``every`` steps (and once after the prefill),
so a step can be captured in a CUDA graph; between two evictions a head holds up to
``every`` tokens more than the policy's budget (the step's own token included).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from lapse.kv import LayerSnapshot


@dataclass(frozen=True, kw_only=True)
class Policy:
    """Base of the eviction policies (keeps everything)."""

    every: int = 16
    """Evict every this many decode steps (1: before every step)."""

    whole_pages = False
    """The kept slots of a head always form a suffix, and keeping a few more than asked
    is harmless: the store drops whole leading pages without moving any token
    (:meth:`lapse.kv.PagedStore.evict`)."""

    snapshot_extras = ()
    """The per-slot pools besides positions, scores and ``c`` that :meth:`keep` reads from
    ``snap.extras`` (e.g. DCP's ``drop``): only these are gathered for a pass, not a
    method's large per-slot state (DCP's interaction keys, CASTLE's ``u``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"every must be a positive integer, got {self.every!r}")

    @property
    def score_decay(self) -> float | None:
        """The decay of the accumulated attention scores the store must track (``None``: none)."""
        return None

    @property
    def keeps_all(self) -> bool:
        """Whether :meth:`keep` is the base's (every valid slot kept): a pass would evict
        nothing, so the store skips it (``Dense``: no pass in a timed prefill)."""
        return type(self).keep is Policy.keep

    @property
    def uniform_heads(self) -> bool:
        """Every kv head of a layer keeps the same slots (a layer-wide decision), which
        kinds that share per-slot state across heads need (DCP)."""
        return True

    def check(self, model: nn.Module) -> None:
        """Raises ``ValueError`` when the policy does not fit the model."""

    def check_context(self, prompt_len: int, max_context: int) -> None:
        """Raises ``ValueError`` when the policy cannot work in ``max_context`` tokens."""

    def max_tokens(self, prompt_len: int) -> int | None:
        """Most tokens a head keeps after an eviction (``None``: not bounded)."""
        return None

    def keep(self, snap: LayerSnapshot) -> Tensor:
        """``[B, H, W]`` bool: the slots each (sequence, kv head) keeps (valid ones only count)."""
        return snap.valid


def resolve_budget(budget: int | float, prompt_len: int) -> int:
    """A budget in tokens: an int as it is, a float in (0, 1] as that share of the prompt."""
    if isinstance(budget, float):
        return max(1, round(budget * prompt_len))
    return budget


def check_budget(budget: int | float) -> None:
    if isinstance(budget, bool) or not (
        (isinstance(budget, int) and budget >= 1) or (isinstance(budget, float) and 0 < budget <= 1)
    ):
        raise ValueError(
            f"budget must be a positive number of tokens or a fraction in (0, 1], got {budget!r}"
        )


def recent_or_sink(snap: LayerSnapshot, recent: int, sinks: int) -> Tensor:
    """``[B, H, W]``: valid slots among the sequence's last ``recent`` positions or its first ``sinks``."""
    last = snap.seqlens[:, None, None]  # [B, 1, 1]
    return snap.valid & ((snap.positions >= last - recent) | (snap.positions < sinks))
