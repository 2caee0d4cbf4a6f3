"""Imported first by the package, before anything imports torch.

torch warns at import ("Failed to initialize NumPy") when numpy is absent, and numpy is not one of
torch's dependencies. moe-core never converts tensors to numpy, so on a clean install that warning is
noise printed by every command (docs/decisions.md, 50). Only that one message is filtered.
"""

import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
