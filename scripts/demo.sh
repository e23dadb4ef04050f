#!/usr/bin/env bash
# The main job: train a sharded model on 2 CPU ranks, saving every step with a paddle_dcp
# CheckpointManager (async_save=True, max_to_keep=2), and resume from its latest step in fresh
# jobs on other layouts (2 ranks with other placements; 1 process without launch) that continue
# exactly where training stopped.
source "$(dirname "$0")/_env.sh"
work="$(mktemp -d "${TMPDIR:-/tmp}/paddle_dcp_demo.XXXXXX")"
trap 'rm -rf "$work"' EXIT
run() {  # run PHASE NPROC (0: one process without the launcher)
    if [ "$2" = 0 ]; then
        cmd=(python scripts/demo.py)
    else
        cmd=(python -m paddle.distributed.launch --nproc_per_node "$2" --log_dir "$work/log_$1" scripts/demo.py)
    fi
    if ! timeout 300 "${cmd[@]}" "$1" --ckpt "$work/ckpt" --work "$work" > "$work/launch_$1.out" 2>&1 \
            || ! grep -q ": OK\|saved" "$work/$1.txt" 2>/dev/null; then
        cat "$work/$1.txt" 2>/dev/null
        echo "demo phase '$1' failed; logs:" >&2
        tail -n 30 "$work/launch_$1.out" "$work/log_$1"/workerlog.* >&2 2>/dev/null
        exit 1
    fi
    cat "$work/$1.txt"
}
run train 2
run resume-other 2
run resume-single 0
echo "DEMO OK"
