"""`python -m exprd`: the same as the `exprd` console script."""

from __future__ import annotations

import sys

from .main import entry

sys.exit(entry())
