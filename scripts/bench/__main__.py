"""The one entry point of the benchmarks: ``python scripts/bench SUITE [options]``.

``python scripts/bench --help`` lists the suites; ``python scripts/bench SUITE --help`` shows a
suite's options. Only the suite asked for is imported (scale imports paddle_dcp, the others
start the processes that do).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

if __package__ in (None, ""):  # run as a directory: import it as the package ``bench``
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from bench import REPO  # noqa: E402

if REPO not in sys.path:  # this checkout's paddle_dcp, not another one installed
    sys.path.insert(1, REPO)

# name -> (module, keyword arguments of its main, what it measures)
SUITES = {
    "io": ("io", {}, "save, load, reshard: speed and memory against paddle's built-in and torch DCP"),
    "s3": ("io", {"storage": "s3"}, "the same on a local S3 server, against torch DCP and the server's own"),
    "many": ("many", {}, "save and load of 10k to 100k small tensors: the time per tensor"),
    "compress": ("compress", {}, "compressed moments and derived master weights: bytes, time, error, resume"),
    "p2p": ("p2p", {}, "bytes between two ranks: our TCP, a gloo pair, the job's communicator"),
    "layouts": ("layouts", {}, "verify, metadata check and load of one tensor in 1k to 64k non-grid pieces: time per piece"),
    "scale": ("scale", {}, "planning and metadata of a save and a load at thousands of simulated ranks"),
    "scale-elastic": ("elastic", {}, "the node-local tier's restore after a lost node, at thousands of simulated ranks"),
    "tiers": ("tiers", {}, "CheckpointManager's node-local tier: restores from each tier, replicated saves"),
}


def _parser() -> argparse.ArgumentParser:
    width = max(len(name) for name in SUITES)
    listing = "\n".join(f"  {name:{width}s}  {what}" for name, (_, _, what) in SUITES.items())
    p = argparse.ArgumentParser(
        prog="bench", description="paddle_dcp's benchmarks: one suite a run, its report on stdout.",
        epilog=f"suites:\n{listing}\n\n'python scripts/bench SUITE --help' shows a suite's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=list(SUITES), metavar="SUITE", help="what to measure (below)")
    p.add_argument("options", nargs=argparse.REMAINDER, help="the suite's options")
    return p


def main(argv: list | None = None) -> int:
    """Run the suite ``argv`` names with the rest of ``argv``; its exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in SUITES:
        _parser().parse_args(argv)  # --help, or the usage error
        return 2
    module, kwargs, _ = SUITES[argv[0]]
    suite = importlib.import_module(f"bench.{module}")
    return suite.main(argv[1:], prog=f"bench {argv[0]}", **kwargs)


if __name__ == "__main__":
    sys.exit(main())
