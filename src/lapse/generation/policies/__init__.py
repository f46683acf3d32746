"""Eviction policies: one small frozen dataclass per policy, one module each.

A policy returns which slots each (sequence, kv head) keeps; the paged store frees the
pages. :data:`POLICIES` maps the command line's names to the classes.
"""

from .a2sf import A2SF
from .acp import ACPBoundary
from .base import Policy
from .dcp import DCPDrop
from .dense import Dense
from .h2o import H2O
from .options import PolicyName, PolicyOptions
from .window import SinkWindow

POLICIES: dict[str, type[Policy]] = {
    "dense": Dense,
    "window": SinkWindow,
    "acp": ACPBoundary,
    "h2o": H2O,
    "a2sf": A2SF,
    "dcp": DCPDrop,
}

__all__ = [
    "A2SF", "ACPBoundary", "DCPDrop", "H2O", "POLICIES", "Dense", "Policy", "PolicyName", "PolicyOptions",
    "SinkWindow",
]
