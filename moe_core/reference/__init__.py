"""Pure-PyTorch reference backends: dispatcher ``standard`` and experts ``reference``.

They form the built-in plugin ``reference`` (always available, on every device), the embedded
default, and the oracle every other backend is tested against.
"""
