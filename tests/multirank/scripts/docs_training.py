"""Run the python code blocks of docs/training.md, in order, in one namespace, as one script.

Usage: docs_training.py DIR (under paddle.distributed.launch, or in one plain process). The
blocks run in DIR (shared by the ranks), where they write their checkpoint and file.
"""
import os
import re
import sys
from pathlib import Path

import paddle.distributed as dist

DOC = Path(__file__).resolve().parents[3] / "docs" / "training.md"


def blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def main() -> None:
    work = sys.argv[1]
    os.makedirs(work, exist_ok=True)
    os.chdir(work)
    code = blocks(DOC.read_text())
    assert len(code) >= 6, f"{DOC}: {len(code)} python blocks"
    namespace = {"__name__": "__docs__"}
    for i, block in enumerate(code, 1):
        exec(compile(block, f"{DOC.name} (python block {i})", "exec"), namespace)
    print(f"PASS docs_training rank={dist.get_rank()}", flush=True)


if __name__ == "__main__":
    main()
