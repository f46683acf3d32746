"""Eviction policies: one small frozen dataclass per policy, one module each.

A policy returns which slots each (sequence, kv head) keeps; the paged store frees the
pages. :data:`POLICIES` maps the command line's names to the classes. Each name loads with
its submodule on first use: the flags (:mod:`.options`) import no torch.
"""

from lapse.lazy import exports

__all__, __getattr__, __dir__ = exports(__name__, {
    ".a2sf": ("A2SF",),
    ".acp": ("ACPBoundary",),
    ".base": ("Policy",),
    ".dcp": ("DCPDrop",),
    ".dense": ("Dense",),
    ".h2o": ("H2O",),
    ".options": ("PolicyName", "PolicyOptions"),
    ".registry": ("POLICIES",),
    ".window": ("SinkWindow",),
})
