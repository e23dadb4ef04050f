"""Never finishes: for the test of the launcher's timeout (every rank waits forever). A rank
says so as soon as it starts, before paddle's import and the group's rendezvous, which on a
busy machine take most of the test's timeout."""
import os
import time

print(f"HANGING rank={os.environ.get('PADDLE_TRAINER_ID')}", flush=True)
import paddle.distributed as dist  # noqa: E402 - after the line the test looks for

dist.init_parallel_env()
while True:
    time.sleep(1)
