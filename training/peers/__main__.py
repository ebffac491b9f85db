"""`python -m training.peers ...`: the same as `enhancer-train bench-peers ...`."""
import sys

from .cli import main

sys.exit(main())
