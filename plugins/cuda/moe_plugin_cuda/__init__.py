"""moe-plugin-cuda: NVIDIA backends for moe-core (imports no vendor library at import time)."""

__version__ = "0.1.0"
