"""paddle_dcp's benchmarks: one entry point, ``python scripts/bench SUITE [options]`` (__main__).

The suites, a module each: io (save, load and reshard against paddle's built-in and torch DCP,
on local disk or, as the suite s3, on a local S3 server), many (many small tensors), layouts
(one tensor in pieces no grid describes), compress (compressed checkpoints), p2p (bytes between two ranks), scale (planning at thousands of
simulated ranks), tiers (CheckpointManager's node-local tier). What they share, once: launch
(ranks under paddle.distributed.launch or torchrun, and their JSON results), machine (the
machine and the speeds that bound any library), report (progress, the report and its JSON),
threads (a function timed in threads), units (sizes and counts), s3 (a local S3 server and its
own speed), workload (io's and many's tensors and their numpy oracle). A worker that a launch
starts on every rank is a file of its own (io_worker, many_worker, p2p_worker, tiers_worker),
run by path.
"""
import os

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(SCRIPTS)
