"""The ``run`` command: a training script run unchanged, with paddle's checkpoint calls routed
to paddle_dcp (:func:`paddle_dcp.patch_paddle`)."""
from __future__ import annotations

import os
import sys
import traceback

from .console import EXIT_PROBLEMS


def cmd_run(args) -> int:
    """Run a training script unchanged, with paddle's checkpoint calls routed to paddle_dcp."""
    import runpy

    import paddle_dcp

    paddle_dcp.patch_paddle(strict=args.strict)
    sys.argv = [args.script, *args.args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    try:
        runpy.run_path(args.script, run_name="__main__")
    except SystemExit as exc:  # the script's own exit code
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception:  # noqa: BLE001 - the script's error, shown as python would
        traceback.print_exc(file=sys.stderr)
        return EXIT_PROBLEMS
    return 0
