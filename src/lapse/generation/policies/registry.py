"""The command line's policy names, each the class it builds (``--policy NAME``)."""

from __future__ import annotations

from .a2sf import A2SF
from .acp import ACPBoundary
from .base import Policy
from .dcp import DCPDrop
from .dense import Dense
from .h2o import H2O
from .window import SinkWindow

POLICIES: dict[str, type[Policy]] = {
    "dense": Dense,
    "window": SinkWindow,
    "acp": ACPBoundary,
    "h2o": H2O,
    "a2sf": A2SF,
    "dcp": DCPDrop,
}
