"""moe-core plugin for AMD ROCm: ``aiter`` experts (AITER ``fused_moe``) and ``mori`` dispatcher.

Importing this package (and its ``plugin`` module) never imports AITER or MoRI: the backend
implementations import them lazily when a plan is built.
"""

__version__ = "0.1.0"
