"""Never finishes: for the test of the launcher's timeout (every rank waits forever)."""
import time

import paddle.distributed as dist

dist.init_parallel_env()
print(f"HANGING rank={dist.get_rank()}", flush=True)
while True:
    time.sleep(1)
