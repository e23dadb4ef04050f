#!/usr/bin/env bash
# The main job: train a sharded model on 2 CPU ranks, save it with paddle_dcp, and resume it
# in a fresh job that continues exactly where training stopped.
source "$(dirname "$0")/_env.sh"
work="$(mktemp -d "${TMPDIR:-/tmp}/paddle_dcp_demo.XXXXXX")"
trap 'rm -rf "$work"' EXIT
run() {  # run PHASE NPROC
    if ! timeout 300 python -m paddle.distributed.launch --nproc_per_node "$2" --log_dir "$work/log_$1" \
            scripts/demo.py "$1" --ckpt "$work/ckpt" --work "$work" > "$work/launch_$1.out" 2>&1; then
        echo "demo phase '$1' failed; worker logs:" >&2
        tail -n 30 "$work/log_$1"/workerlog.* >&2
        exit 1
    fi
    cat "$work/$1.txt"
}
run train 2
run resume 2
