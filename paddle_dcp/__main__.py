"""``python -m paddle_dcp``: the command line (see :mod:`paddle_dcp.tools.cli`)."""
import sys

from .tools.cli import main

sys.exit(main())
