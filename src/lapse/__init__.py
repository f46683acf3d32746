"""lapse: attention that forgets (FoX, ACP, CASTLE, DCP, KV-cache eviction)."""

__version__ = "0.2.0"
