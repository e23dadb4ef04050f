"""A CheckpointManager's record of the steps it saved (its manifest, JSON) and the retention
policy: which of them to keep. Pure: no paddle, no files.

The manifest names only steps the manager itself saved; retention chooses among those, so a
checkpoint copied into the directory, or another job's ids, are never deleted. Each entry
has a state: ``writing`` (recorded before its first byte is written), ``complete`` (its
metadata committed), ``deleting`` (chosen for deletion, its files being removed).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

from ..errors import ArgumentError, FormatError
from .job_layout import JobLayout
from .json_text import parse_json

MANIFEST_NAME = "paddle_dcp_manager.json"
MANIFEST_FORMAT = "paddle_dcp.manager"
MANIFEST_VERSION = 1
STATES = ("writing", "complete", "deleting")


@dataclass(frozen=True)
class StepEntry:
    """One step the manager saved.

    Attributes:
        step: the training step; the checkpoint's unique id in the directory.
        state: ``writing``, ``complete`` or ``deleting``.
        metrics: the metrics given with the save (JSON values), or None.
        layout: the layout the step was saved on (None: not recorded, as by versions before
            it was).
    """

    step: int
    state: str
    metrics: Mapping[str, Any] | None = None
    layout: JobLayout | None = None


@dataclass(frozen=True)
class Manifest:
    """Every step a manager saved and has not finished deleting, by step."""

    steps: Mapping[int, StepEntry] = field(default_factory=dict)

    def with_entry(self, entry: StepEntry) -> "Manifest":
        return Manifest({**self.steps, entry.step: entry})

    def with_state(self, steps: Iterable[int], state: str) -> "Manifest":
        return Manifest({**self.steps, **{s: replace(self.steps[s], state=state) for s in steps if s in self.steps}})

    def without(self, steps: Iterable[int]) -> "Manifest":
        gone = set(steps)
        return Manifest({s: e for s, e in self.steps.items() if s not in gone})

    def complete(self) -> list[int]:
        return sorted(s for s, e in self.steps.items() if e.state == "complete")

    def to_json(self) -> bytes:
        entries = [
            {"step": e.step, "state": e.state, "metrics": None if e.metrics is None else dict(e.metrics),
             **({} if e.layout is None else {"layout": e.layout.to_json()})}
            for e in sorted(self.steps.values(), key=lambda e: e.step)
        ]
        return json.dumps({"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "steps": entries}, indent=1).encode()

    @staticmethod
    def from_json(data: bytes, source: str = MANIFEST_NAME) -> "Manifest":
        try:
            doc = parse_json(data, source, "the manifest")
            if not isinstance(doc, dict):
                raise FormatError(f"{source} is not a paddle_dcp manager manifest (not a JSON object)")
            if doc.get("format") != MANIFEST_FORMAT:
                raise FormatError(f"{source} is not a paddle_dcp manager manifest (format {doc.get('format')!r})")
            if doc.get("version") != MANIFEST_VERSION:
                raise FormatError(f"{source}: manifest version {doc.get('version')!r}; this version reads {MANIFEST_VERSION}")
            steps = {}
            for item in doc["steps"]:
                step, state, metrics = item["step"], item["state"], item["metrics"]
                if type(step) is not int or step < 0 or state not in STATES or not (metrics is None or isinstance(metrics, dict)):
                    raise FormatError(f"{source}: bad entry {item!r}")
                layout = None if item.get("layout") is None else JobLayout.from_json(item["layout"], source)
                steps[step] = StepEntry(step, state, metrics, layout)
            return Manifest(steps)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise FormatError(f"{source} is not a readable manager manifest: {exc}") from exc


def check_metrics(metrics: Any) -> dict | None:
    """``metrics`` as a dict of JSON values (str keys), or ArgumentError naming what is not."""
    if metrics is None:
        return None
    if not isinstance(metrics, Mapping) or not all(isinstance(k, str) for k in metrics):
        raise ArgumentError(f"metrics must be a dict with str keys or None, got {type(metrics).__name__}")
    try:
        return json.loads(json.dumps(dict(metrics)))
    except (TypeError, ValueError) as exc:
        raise ArgumentError(f"metrics must hold JSON values (numbers, strings, lists, dicts): {exc}") from exc


def score(value: Any, best_mode: str) -> float | None:
    """A best_fn value as a number where larger is better (None: no usable value)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return float(value) if best_mode == "max" else -float(value)


def to_delete(
    manifest: Manifest,
    max_to_keep: int | None,
    keep_every_n_steps: int | None = None,
    scores: Mapping[int, float | None] | None = None,
    protected: Iterable[int] = (),
) -> list[int]:
    """The steps of ``manifest`` to delete, ascending.

    Kept: every step in ``protected`` (the one being written); the newest complete step; every
    complete step that is a multiple of ``keep_every_n_steps``; and of the other complete
    steps, the ``max_to_keep`` newest, or with ``scores`` (step -> larger-is-better, None for
    no value) the ``max_to_keep`` best (ties: the newer), steps without a value ranked last.
    ``max_to_keep=None`` keeps every complete step. Steps left ``writing`` or ``deleting`` by
    a save or deletion that did not finish are deleted (their files are the manager's own).
    """
    protect = set(protected)
    complete = manifest.complete()
    unfinished = [s for s, e in manifest.steps.items() if e.state != "complete" and s not in protect]
    if not complete:
        return sorted(unfinished)
    keep = {complete[-1]} | protect
    if keep_every_n_steps:
        keep |= {s for s in complete if s % keep_every_n_steps == 0}
    candidates = [s for s in complete if s not in keep or s == complete[-1]]
    if max_to_keep is None:
        keep |= set(complete)
    else:
        if scores is None:
            ranked = sorted(candidates, reverse=True)
        else:
            ranked = sorted(candidates, key=lambda s: (scores.get(s) is not None, scores.get(s) or 0.0, s), reverse=True)
        keep |= set(ranked[:max_to_keep])
    return sorted(set(unfinished) | {s for s in complete if s not in keep})
