"""The command line's arguments: ``python -m paddle_dcp`` / ``paddle-dcp`` inspect | verify |
convert | import-paddle | clean | run parsed, and the command run with the process's logging.

Each command's logic lives in its own module (``inspection``, ``verify``, ``convert``,
``import_paddle``, ``clean``, ``run``); what they share (exit codes, errors, progress) in
``console``.

Exit codes: 0 all good, 1 problems found (a damaged or incomplete checkpoint, an error while
reading or writing), 2 bad usage (arguments, a directory or id that does not exist, an import
without ``--trust``). Errors are one line on stderr; ``--debug`` adds the traceback. Results go
to stdout, progress and logs to stderr. ``inspect``, ``verify``, ``clean`` and ``convert`` to
safetensors or npz never import paddle.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from typing import Sequence

from .console import EXIT_PROBLEMS, EXIT_USAGE, PROG, UsageError, _err, _one_line, printable
from .clean import cmd_clean
from .convert import FORMATS, cmd_convert
from .import_paddle import cmd_import_paddle
from .inspection import cmd_inspect
from .run import cmd_run
from .verify import cmd_verify
from ..io import default_storage_options, is_url
from ..errors import DcpError
from ..version import __version__

logger = logging.getLogger(__name__)


# ====================================================================== parser
def _storage_options(args) -> dict | None:
    """The --storage-option KEY=VALUE pairs as a dict (None when there are none)."""
    pairs = getattr(args, "storage_option", None)
    if not pairs:
        return None
    if not is_url(getattr(args, "path", "")):
        raise UsageError(f"--storage-option applies to a URL (s3://bucket/prefix), not {args.path}")
    out = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--storage-option takes KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(text)
        except ValueError:
            out[key] = text
    return out


def _unique_id(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {value}")
    return value


ID_HELP = "the checkpoint id (default: the highest complete one)"


def _shared_options() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """(options of every command, the --progress option of the long ones), as parent parsers."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks and debug logs")
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log what is done (INFO)")
    common.add_argument(
        "--storage-option", action="append", default=None, metavar="KEY=VALUE",
        help="for an s3:// (fsspec) PATH: an option for fsspec or paddle_dcp (VALUE read as JSON when it "
        "parses, else as a string), e.g. endpoint_url=http://127.0.0.1:8333; repeatable. The AWS_* "
        "variables are read too",
    )
    progress = argparse.ArgumentParser(add_help=False)
    progress.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None,
        help="a progress bar on stderr (default: only when stderr is a terminal)",
    )
    return common, progress


def _add_inspect(sub, common, progress) -> None:
    """The ``inspect`` command."""
    p = sub.add_parser(
        "inspect", parents=[common], help="ids, tensors, files and values of a checkpoint",
        description="List the ids in PATH (complete, incomplete, temporary files) and describe one "
        "checkpoint: every key with global shape, dtype, saved pieces and bytes; its data files; "
        "its plain values; total bytes. Reads the metadata only.",
    )
    p.add_argument("path", metavar="PATH", help="checkpoint directory")
    p.add_argument("--unique-id", type=_unique_id, metavar="N", help=ID_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON document (non-finite floats as \"nan\", \"inf\")")
    p.set_defaults(func=cmd_inspect)


def _add_verify(sub, common, progress) -> None:
    """The ``verify`` command."""
    p = sub.add_parser(
        "verify", parents=[common, progress], help="check every checksum, file size and tiling",
        description="Check a checkpoint against its metadata, everything a load checks: the "
        "metadata's digest (edited or damaged after it was written), every tensor entry (pieces inside "
        "the tensor and tiling it exactly), every data file's presence and size, and the checksum "
        "of every block of every piece (read in windows of bounded size). Exit 0 when all is "
        "good, 1 listing each problem with its file and key.",
    )
    p.add_argument("path", metavar="PATH", help="checkpoint directory")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--unique-id", type=_unique_id, metavar="N", help=ID_HELP)
    which.add_argument("--all", action="store_true", help="every complete checkpoint in PATH")
    p.set_defaults(func=cmd_verify)


def _add_convert(sub, common, progress) -> None:
    """The ``convert`` command."""
    p = sub.add_parser(
        "convert", parents=[common, progress], help="write full tensors to safetensors, pdparams, npz or a HF directory",
        description="Write the full (global) tensors of a checkpoint to one file, or with --to hf to "
        "a Hugging Face directory (model-0000i-of-0000N.safetensors shards of at most "
        "--max-shard-size and model.safetensors.index.json, written last). safetensors and "
        "npz are streamed: at most one slab of 64 MiB of a tensor is in memory at a time, whatever "
        "the checkpoint's size. pdparams is written with paddle.save and holds every selected "
        "tensor in memory. bfloat16: BF16 in safetensors (numpy readers cannot load it: use "
        "--bf16-as-float32), bfloat16 tensors in pdparams, uint16 bit patterns in npz. Plain "
        "values go to safetensors' __metadata__ (as JSON text), to the pdparams dict, and to the "
        "npz member __metadata__ (JSON with every tensor's dtype). With --to hf --aoa-config FILE, "
        "the tensors are written under the names that config reads on a load (Hugging Face names): "
        "paddle's AOA engine runs it backwards, each tensor is built slab by slab from boxes of the "
        "checkpoint's tensors (split, transposed, cast as the config says). Not reversible: dtype= "
        "(use src_dtype=..., dst_dtype=...) and * over Hugging Face names are refused; a merge of "
        "parts of unequal sizes (a, b -> ab, axis=N) is split evenly back.",
    )
    p.add_argument("path", metavar="PATH", help="checkpoint directory")
    p.add_argument("out", metavar="OUT", help="the file to write (replaced once complete); for --to hf, a new directory")
    p.add_argument("--to", choices=FORMATS, help="output format (default: from OUT's extension); hf: a Hugging Face "
                   "directory of safetensors shards and model.safetensors.index.json")
    p.add_argument("--max-shard-size", metavar="SIZE", help="--to hf: data per shard at most (default 5GB; powers of 1024)")
    p.add_argument("--aoa-config", metavar="FILE", help="--to hf: a JSON file {\"aoa_statements\": [...]}, the config "
                   "load_state_dict(aoa_config=...) takes to read the HF directory into the model; the export applies it "
                   "backwards (paddle's AOA engine) and writes the HF names; needs paddle; model weights only")
    p.add_argument("--keys", metavar="REGEX", help="only keys (and values) matching REGEX (re.search); "
                   "with --aoa-config, the names written")
    p.add_argument("--unique-id", type=_unique_id, metavar="N", help=ID_HELP)
    p.add_argument("--bf16-as-float32", action="store_true", help="write bfloat16 tensors as float32 (exact)")
    p.set_defaults(func=cmd_convert)


def _add_import_paddle(sub, common, progress) -> None:
    """The ``import-paddle`` command."""
    p = sub.add_parser(
        "import-paddle", parents=[common, progress],
        help="convert a checkpoint of paddle.distributed.save_state_dict into ours (needs --trust)",
        description="Convert a checkpoint written by paddle.distributed.save_state_dict (pickled "
        "N.metadata and {rank}_N.distcp files, or .safetensors data files) into a paddle_dcp "
        "checkpoint in OUT with the same id, keys and pieces: each rank file becomes our "
        "{rank}_N.distcp; the metadata is written last. Reading paddle's files unpickles them, "
        "which runs any code their author put there, so the command refuses unless --trust is "
        "given. Needs paddle; holds one rank file's tensors in memory at a time.",
    )
    p.add_argument("path", metavar="PATH", help="directory of paddle's checkpoint")
    p.add_argument("out", metavar="OUT", help="directory of the new checkpoint (not PATH)")
    p.add_argument("--unique-id", type=_unique_id, metavar="N", help="paddle's checkpoint id (default: the highest)")
    p.add_argument("--trust", action="store_true", help="I trust these files: unpickling them may run code")
    p.set_defaults(func=cmd_import_paddle)


def _add_clean(sub, common, progress) -> None:
    """The ``clean`` command."""
    p = sub.add_parser(
        "clean", parents=[common], help="remove leftovers of crashed saves",
        description="Remove temporary files (*.tmp.*) of saves that crashed. With --incomplete, "
        "also the data files of ids without metadata in PATH and data files of complete "
        "checkpoints that their metadata does not list. Never run it while a save to PATH is in "
        "progress. WARNING: on node-local disks, a node without the metadata file holds data "
        "files of complete checkpoints: --incomplete there deletes them; use it on shared "
        "storage only.",
    )
    p.add_argument("path", metavar="PATH", help="checkpoint directory")
    p.add_argument("--incomplete", action="store_true", help="also data files no metadata here uses (see WARNING)")
    p.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    p.set_defaults(func=cmd_clean)


def _add_run(sub, common, progress) -> None:
    """The ``run`` command."""
    p = sub.add_parser(
        "run", help="run a script with paddle's checkpoint calls routed to paddle_dcp",
        description="Run SCRIPT (with its ARGS) as python would, after paddle_dcp.patch_paddle(): "
        "its paddle.distributed.save_state_dict / load_state_dict, paddle.load of a paddle_dcp "
        "metadata file and dist.shard_layer go to paddle_dcp, with paddle's contract for missing "
        "keys (--strict: paddle_dcp's error). Under paddle's launcher: python -m "
        "paddle.distributed.launch --nproc_per_node N paddle-dcp run train.py ARGS.",
    )
    p.add_argument("--strict", action="store_true", help="a key the checkpoint lacks is an error, not a warning")
    p.add_argument("script", metavar="SCRIPT", help="the python script to run, unchanged")
    p.add_argument("args", metavar="ARGS", nargs=argparse.REMAINDER, help="its arguments")
    p.set_defaults(func=cmd_run)


def build_parser() -> argparse.ArgumentParser:
    common, progress = _shared_options()
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect, verify, convert and clean paddle_dcp checkpoints; run a script with paddle's "
        "checkpoint calls routed to paddle_dcp.",
        epilog="Exit codes: 0 ok, 1 problems found, 2 bad usage. Run '%(prog)s COMMAND --help' for details.",
    )
    parser.add_argument("--version", action="version", version=f"paddle_dcp {__version__}")
    parser.add_argument("--debug", action="store_true", default=False, help="show tracebacks and debug logs")
    parser.add_argument("-v", "--verbose", action="store_true", default=False, help="log what is done (INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for add in (_add_inspect, _add_verify, _add_convert, _add_import_paddle, _add_clean, _add_run):
        add(sub, common, progress)
    return parser


# ====================================================================== main
class _Printable(logging.Formatter):
    """Log messages with their control characters escaped, as every line the commands print (a
    traceback after one keeps its lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return printable(super().formatMessage(record))


class _Logging:
    """A handler on the ``paddle_dcp`` logger for the duration of one command."""

    def __init__(self, level: int):
        self.logger = logging.getLogger("paddle_dcp")
        self.level = level

    def __enter__(self):
        self.handler = logging.StreamHandler(sys.stderr)
        self.handler.setFormatter(_Printable(f"{PROG}: %(levelname)s: %(message)s"))
        self.saved = (self.logger.level, self.logger.propagate)
        self.logger.addHandler(self.handler)
        self.logger.setLevel(self.level)
        self.logger.propagate = False
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.saved[0])
        self.logger.propagate = self.saved[1]


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit code (0 ok, 1 problems found, 2 bad usage)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error argparse printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    debug = getattr(args, "debug", False)
    level = logging.DEBUG if debug else (logging.INFO if getattr(args, "verbose", False) else logging.WARNING)
    with _Logging(level):
        try:
            with default_storage_options(_storage_options(args)):
                return args.func(args)
        except KeyboardInterrupt:
            _err(f"{PROG}: interrupted")
            return 130
        except BrokenPipeError:  # e.g. piped into head: stop quietly
            try:
                sys.stdout = open(os.devnull, "w")
            except OSError:
                pass
            return EXIT_PROBLEMS
        except Exception as exc:  # noqa: BLE001 - every error becomes one line
            if debug:
                traceback.print_exc(file=sys.stderr)
            if isinstance(exc, UsageError):
                _err(f"{PROG}: error: {_one_line(exc)}")
                return EXIT_USAGE
            if isinstance(exc, DcpError):
                _err(f"{PROG}: error: {_one_line(exc)}")
            else:
                hint = "" if debug else " (run with --debug for the traceback)"
                _err(f"{PROG}: error: {type(exc).__name__}: {_one_line(exc)}{hint}")
            return EXIT_PROBLEMS


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
