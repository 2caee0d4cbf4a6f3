"""``python -m moe_core``: the ``moe-core`` command line."""

import sys

from moe_core.cli import main

sys.exit(main())
