"""``python -m paddle_dcp``: the command line (see :mod:`paddle_dcp.cli`)."""
import sys

from .cli import main

sys.exit(main())
