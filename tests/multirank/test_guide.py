"""The examples of docs/guide.md, run as the guide marks them, in order, in one directory.

Every fenced block preceded by an HTML comment ``<!-- run: ... -->`` is an example:

- ``<!-- run: single -->``: a python block run as a script in one plain process (no launch);
- ``<!-- run: launch N -->``: a python block run on N ranks under
  ``python -m paddle.distributed.launch --nproc_per_node N``;
- ``<!-- run: file NAME -->``: a python block written to NAME in the working directory, for a
  later shell block to run;
- ``<!-- run: shell -->``: a bash block run with ``bash -e -o pipefail`` (``python`` on PATH is
  this interpreter).

A python example's first line names its file and how it runs (``# train.py: python -m
paddle.distributed.launch --nproc_per_node 2 train.py``); readers see that line and not the
marker, so the command must be the one the marker says. The example is saved under that name
in a directory beside the working one (a ``file`` block in the working directory itself), a
shell block as ``blockNN.sh``.

A ```text block preceded by ``<!-- output -->`` right after an example is what the example
prints: each of its lines (``...`` lines aside) must appear in the example's output (stdout and
stderr; for a launch, the worker logs of every rank in rank order), in order, each within one
line. Every python block of the guide must be an example, so no example escapes the test. Each
run has a timeout; on a timeout, or when a shell block fails, the processes it started, and
only those, are killed (tests/multirank/launcher.py).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from launcher import REPO, _env, _kill, _tail, run_launch, run_single

GUIDE = REPO / "docs" / "guide.md"
MARK = re.compile(r"<!--\s*run:\s*(single|launch\s+\d+|shell|file\s+\S+)\s*-->")
OUTPUT = re.compile(r"<!--\s*output\s*-->")
NAME = re.compile(r"#\s*([A-Za-z0-9_]+\.py)\b")
HEADER = re.compile(r"#\s*([A-Za-z0-9_]+\.py):\s*(.+?)\s*")
TIMEOUT = {"single": 60, "launch": 90, "shell": 120}


@dataclass
class Example:
    kind: str  # single | launch | shell | file
    arg: str  # ranks of a launch, file name of a file block
    lang: str
    code: str
    line: int  # 1-based line of the fence in the guide
    expect: list[str] | None = None

    def where(self) -> str:
        return f"docs/guide.md:{self.line} ({self.kind}{' ' + self.arg if self.arg else ''})"


def parse(text: str) -> list[Example]:
    """The examples of the guide, in order, with the output each one shows."""
    lines = text.splitlines()
    examples: list[Example] = []
    pending = None  # ("run", kind, arg) or ("output",), waiting for its fence
    last_fence_was_example = False
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        mark, out = MARK.fullmatch(stripped), OUTPUT.fullmatch(stripped)
        if mark or out:
            assert pending is None, f"docs/guide.md:{i + 1}: a marker follows a marker without a block between"
            if mark:
                kind, _, arg = mark.group(1).partition(" ")
                pending = ("run", kind, arg.strip())
            else:
                assert last_fence_was_example, f"docs/guide.md:{i + 1}: <!-- output --> does not follow an example"
                pending = ("output",)
        elif stripped.startswith("```"):
            lang = stripped[3:].strip()
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith("```"):
                j += 1
            assert j < len(lines), f"docs/guide.md:{i + 1}: unclosed code block"
            body = "\n".join(lines[i + 1 : j]) + "\n"
            if pending and pending[0] == "run":
                kind, arg = pending[1], pending[2]
                want = "bash" if kind == "shell" else "python"
                assert lang == want, f"docs/guide.md:{i + 1}: a '{kind}' example must be a ```{want} block, not {lang!r}"
                examples.append(Example(kind, arg, lang, body, i + 1))
                last_fence_was_example = True
            elif pending and pending[0] == "output":
                assert lang == "text", f"docs/guide.md:{i + 1}: an output must be a ```text block"
                examples[-1].expect = [ln.strip() for ln in body.splitlines() if ln.strip() and ln.strip() != "..."]
                last_fence_was_example = False
            else:
                assert lang != "python", f"docs/guide.md:{i + 1}: a python block without <!-- run: ... -->"
                last_fence_was_example = False
            pending = None
            i = j
        elif stripped and pending is not None:
            raise AssertionError(f"docs/guide.md:{i + 1}: a marker is not followed by a code block")
        i += 1
    assert pending is None, "docs/guide.md: a marker at the end without a block"
    return examples


def check_output(example: Example, output: str) -> None:
    """Each expected line appears, in order, within one line of ``output``."""
    if not example.expect:
        return
    got = output.splitlines()
    pos = 0
    for want in example.expect:
        while pos < len(got) and want not in got[pos]:
            pos += 1
        if pos == len(got):
            pytest.fail(
                f"{example.where()}: the guide shows the line\n  {want}\nwhich the example did not print "
                f"(after the lines matched before it). Its output:\n{_tail(output, 80)}",
                pytrace=False,
            )
        pos += 1


def run_shell(path: Path, work: Path, timeout: float) -> str:
    env = _env()
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    proc = subprocess.Popen(
        ["bash", "-e", "-o", "pipefail", str(path)], cwd=str(work), env=env, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)  # its own process group, and the launchers and workers it started
        output, _ = proc.communicate()
        pytest.fail(f"{path.name} did not finish in {timeout} s; its processes were killed\n{_tail(output)}",
                    pytrace=False)
    if proc.returncode != 0:
        _kill(proc)  # anything it left running in its process group
        pytest.fail(f"{path.name} failed (exit code {proc.returncode})\n{_tail(output)}", pytrace=False)
    return output


def test_guide_structure():
    """The guide holds examples of every kind, and a python block is never left unmarked."""
    examples = parse(GUIDE.read_text())
    kinds = {e.kind for e in examples}
    assert {"single", "launch", "shell"} <= kinds, kinds
    assert len(examples) >= 10, len(examples)
    assert sum(1 for e in examples if e.expect) >= 8
    names = []
    for e in examples:
        if e.lang != "python":
            continue
        first = e.code.splitlines()[0] if e.code.strip() else ""
        m = HEADER.fullmatch(first)
        assert m, f"{e.where()}: the first line must be '# NAME.py: how it runs', not {first!r}"
        name, how = m.group(1), m.group(2)
        names.append(name)
        if e.kind == "file":
            assert name == e.arg, f"{e.where()}: the block names itself {name}, its marker {e.arg}"
        else:  # the command the reader sees is the one the test runs
            want = f"python {name}" if e.kind == "single" else (
                f"python -m paddle.distributed.launch --nproc_per_node {e.arg} {name}")
            assert how == want, f"{e.where()}: the first line says {how!r}; the block runs as {want!r}"
    assert len(names) == len(set(names)), f"two examples with one file name: {names}"


def test_guide_examples(tmp_path):
    examples = parse(GUIDE.read_text())
    work, scripts = tmp_path / "work", tmp_path / "examples"
    work.mkdir()
    scripts.mkdir()
    timings = []
    for n, example in enumerate(examples, 1):
        started = time.monotonic()
        if example.kind == "file":
            (work / example.arg).write_text(example.code)
            continue
        named = NAME.match(example.code) if example.lang == "python" else None
        path = scripts / (named.group(1) if named else f"block{n:02d}.{'sh' if example.kind == 'shell' else 'py'}")
        path.write_text(example.code)
        failure = None
        try:
            if example.kind == "single":
                output = run_single(str(path), work, timeout=TIMEOUT["single"])
            elif example.kind == "launch":
                output = run_launch(str(path), int(example.arg), work, timeout=TIMEOUT["launch"])
            elif example.kind == "shell":
                output = run_shell(path, work, TIMEOUT["shell"])
            else:
                raise AssertionError(f"{example.where()}: unknown kind {example.kind!r}")
        except pytest.fail.Exception as exc:  # say which example, once
            failure = str(exc)
        if failure is not None:
            pytest.fail(f"{example.where()}: {failure}", pytrace=False)
        check_output(example, output)
        timings.append(f"{time.monotonic() - started:5.1f} s  {example.where()}")
    print("\n".join(timings))
