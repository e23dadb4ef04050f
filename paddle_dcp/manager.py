"""CheckpointManager: a training loop's checkpoints in one directory, saved every N steps
(asynchronously if asked), restored from the latest, the old ones deleted by a retention
policy that only ever touches checkpoints the manager wrote.

Steps are checkpoint ids: step N is ``{N}.metadata`` and ``{rank}_{N}.distcp`` in the
directory, loadable with ``load_state_dict(..., unique_id=N)`` without the manager. The
manager records the steps it saved, their state and metrics in ``paddle_dcp_manager.json``
(written atomically by the coordinator; :mod:`paddle_dcp.core.retention`). A step is recorded
``writing`` before any of its bytes are written and ``complete`` once its metadata committed;
retention runs only after a commit, never deletes the newest complete step nor the step being
written, marks the chosen steps ``deleting``, removes their metadata (the coordinator), then
every rank removes its own data files (node-local disks included), and the steps leave the
manifest last. A crash anywhere leaves the newest complete step loadable; steps a crash left
``writing`` or ``deleting`` are cleaned up when a manager next opens the directory.
"""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import stat
from typing import Any, Callable

from .io import cleanup
from . import async_save as background_saves
from .parallel.state import STATE
from .api import run_save
from .core.compress import policy_of
from .core.job_layout import JobLayout
from .parallel.options import SaveOptions
from .parallel.ranks import LocalLoadRank, LocalSaveRank
from .core.naming import metadata_name
from .core.retention import MANIFEST_NAME, Manifest, StepEntry, check_metrics, score, to_delete
from .parallel import protocol
from .parallel.comm import Comm, make_comm
from .parallel.placements import meshes_of
from .tiers import LocalTier, RestoreReport, Restored
from .errors import ArgumentError, DcpError, FormatError, StorageError
from .io import is_url, open_storage, storage

logger = logging.getLogger(__name__)

LOCK_NAME = "paddle_dcp_manager.lock"


class CheckpointManager:
    """Save a training loop's state every ``save_interval_steps`` steps and keep a few.

    Args:
        directory: where the checkpoints go; step N is checkpoint id N in it.
        max_to_keep: how many complete steps to keep (the newest; with ``best_fn`` the best),
            besides those kept by ``keep_every_n_steps``; None keeps all. The newest complete
            step is always kept, even when ``best_fn`` ranks it out.
        keep_every_n_steps: also keep, for good, every step that is a multiple of it.
        save_interval_steps: :meth:`save` saves steps that are multiples of it (or ``force``).
        async_save: saves return once the state is staged in host memory; writing, the commit
            and retention run in the background (see ``save_state_dict(async_save=True)``).
        best_fn: ``metrics -> number``: rank the steps by it for ``max_to_keep``; steps saved
            without metrics (or whose value is not a number) rank last.
        best_mode: ``"max"`` (larger is better) or ``"min"``.
        process_group / coordinator_rank: as for ``save_state_dict``; every rank of the group
            makes the manager and calls :meth:`save`, :meth:`restore`, :meth:`wait` and
            :meth:`close` together.
        storage_options: for a URL ``directory`` (``s3://bucket/prefix``), as for
            ``save_state_dict``.
        local_directory: a node-local tier: a path each node has for itself (under
            ``/dev/shm`` or a local SSD; the same path string on every rank). Steps that are
            multiples of ``local_interval_steps`` are saved there, the newest
            ``local_max_to_keep`` kept, and each rank's data copied to ranks of ``replicas``
            other nodes (to every other node when there are fewer, as after the loss of a
            node: the manager opens with a warning on every rank, and files saved then have
            fewer copies); :meth:`restore` takes each file from the nearest intact copy (see
            :mod:`paddle_dcp.tiers`). A step due for both tiers is staged once: the global
            tier's files are the local step's, copied. None (the default): no local tier.
        local_interval_steps / local_max_to_keep / replicas: see ``local_directory``.
        compress: ``{regex: encoding}``, as for ``save_state_dict``: the tensors stored
            quantized, in both tiers (e.g. ``paddle_dcp.ADAMW_MOMENTS_INT8``).

    Raises:
        ArgumentError: a bad argument (``replicas`` below 0, for one), or another manager
            already uses ``directory`` (a lock file the coordinator holds while the manager is
            open; local directories only).
    """

    def __init__(
        self,
        directory: str,
        max_to_keep: int | None = None,
        keep_every_n_steps: int | None = None,
        save_interval_steps: int = 1,
        async_save: bool = False,
        best_fn: Callable[[dict], Any] | None = None,
        best_mode: str = "max",
        process_group=None,
        coordinator_rank: int = 0,
        *,
        storage_options: dict | None = None,
        local_directory: str | None = None,
        local_interval_steps: int = 1,
        local_max_to_keep: int = 2,
        replicas: int = 1,
        compress: dict[str, str] | None = None,
    ):
        _check_count("max_to_keep", max_to_keep, allow_none=True)
        _check_count("local_interval_steps", local_interval_steps)
        _check_count("local_max_to_keep", local_max_to_keep)
        _check_count("keep_every_n_steps", keep_every_n_steps, allow_none=True)
        _check_count("save_interval_steps", save_interval_steps)
        if best_mode not in ("max", "min"):
            raise ArgumentError(f"best_mode must be 'max' or 'min', got {best_mode!r}")
        if best_fn is not None and not callable(best_fn):
            raise ArgumentError(f"best_fn must be callable or None, got {type(best_fn).__name__}")
        self.directory = os.fspath(directory)
        self.max_to_keep, self.keep_every_n_steps = max_to_keep, keep_every_n_steps
        self.save_interval_steps, self.async_save = save_interval_steps, bool(async_save)
        self.best_fn, self.best_mode = best_fn, best_mode
        self.process_group, self.coordinator_rank = process_group, coordinator_rank
        self.storage_options = storage_options
        self.compress = policy_of(compress)
        self.store = open_storage(self.directory, storage_options)
        self.comm = make_comm(process_group, coordinator_rank)
        self.local_interval_steps = local_interval_steps
        self.local = None if local_directory is None else LocalTier(local_directory, self.comm, replicas, local_max_to_keep)
        self.last_restore: RestoreReport | None = None
        self._manifest = Manifest()
        self._pending: list[background_saves.AsyncSave] = []
        self._lock_file = None
        self._closed = False
        self._open()

    # ------------------------------------------------------------------ public
    def save(self, step: int, state_dict: dict, metrics: dict | None = None, force: bool = False) -> bool:
        """Save ``state_dict`` as ``step`` when an interval says so (or ``force``): to the
        global tier every ``save_interval_steps`` steps, to the local tier (when there is
        one) every ``local_interval_steps``.

        Waits for this manager's previous save (and raises its error), records the step,
        saves it as checkpoint id ``step``, then, once it committed (in the background with
        ``async_save``), applies the retention policy. A step due for both tiers is staged
        once: saved to the local tier, whose files are then copied to the global one.

        Returns:
            True when the step is saved (or being saved), False when the intervals skip it.

        Raises:
            ArgumentError: a bad step or metrics, or a step this manager already holds.
            CollectiveError / DcpError: this save's failure, or the previous async save's.
        """
        self._check_open()
        if type(step) is not int or step < 0:
            raise ArgumentError(f"step must be a non-negative int, got {step!r}")
        metrics = check_metrics(metrics)
        due_global = force or step % self.save_interval_steps == 0
        due_local = self.local is not None and (force or step % self.local_interval_steps == 0)
        if not due_global and not due_local:
            return False
        self.wait()
        layout = self._layout(state_dict)
        if due_global:
            if step in self._manifest.complete():
                raise ArgumentError(f"step {step} is already saved in {self.directory}")
            entry = StepEntry(step, "writing", metrics, layout)
            self._decide(self.comm, "record step", lambda m: (m.with_entry(entry), None))
        background_saves.wait_async_save()  # every save of the process before it, as save_state_dict does
        if due_local:
            rank = self.local.save_rank(step, state_dict, self.async_save, self.compress)
            after = self.local.after_save(rank, layout)
            if due_global:  # the local step's files are the global tier's
                after += (self.local.upload_step(step, self.store), self._recorded(step))
            path = self.local.directory
        else:
            options = SaveOptions(staged=self.async_save, compress=self.compress)
            rank = LocalSaveRank.of_process(self.comm, state_dict, self.store, step, options)
            after = (lambda result: protocol.publish(rank, result), self._recorded(step))
            path = self.directory
        handle = run_save(self.comm, rank, path, after)
        self._pending = [handle] if self.async_save else []
        return True

    def _recorded(self, step: int) -> protocol.Step:
        """The step after a global save: ``step`` marked complete in the manifest, then
        retention."""
        def record(result: protocol.SaveResult) -> protocol.Protocol:
            yield from self._decision(self.comm, "mark step complete", lambda m: (m.with_state([step], "complete"), None), True)
            yield from self._retention(self.comm)

        return record

    def restore(self, state_dict: dict, step: int | None = None) -> int:
        """Load the newest restorable step (or ``step``) into ``state_dict``; returns it.

        With a local tier, the ranks agree on the newest step every piece of which has an
        intact copy in some tier, and each file comes from the nearest copy: the rank's own
        node, a copy on another node, else the global tier; a source whose bytes do not verify
        is passed over (logged on every rank) and ``last_restore`` tells what was used.

        Raises:
            FormatError: no step can be restored (or ``step`` cannot), naming why.
        """
        self._check_open()
        self.wait()
        if step is not None and (type(step) is not int or step < 0):
            raise ArgumentError(f"step must be a non-negative int or None, got {step!r}")
        local = self.local.steps() if self.local is not None else frozenset()
        held = set(self._manifest.complete())
        if step is not None and step not in local | held:
            raise FormatError(f"step {step} is in no tier of {self.directory}: it holds {sorted(local | held) or 'none'}")
        candidates = [step] if step is not None else sorted(local | held, reverse=True)
        refused: list[tuple[str, int, str]] = []
        for s in candidates:
            if s in local:
                try:
                    got, why = self.local.restore(state_dict, s, self.store if s in held else None)
                except DcpError as exc:
                    got, why = None, str(exc).replace("\n", " ")
                if got is not None:
                    return self._restored(s, "local", got, refused, state_dict)
                self._refuse(refused, "local", s, why)
            if s in held:
                try:
                    got = self._load_global(state_dict, s)
                except DcpError as exc:
                    self._refuse(refused, "global", s, str(exc).replace("\n", " "))
                    continue
                return self._restored(s, "global", got, refused, state_dict)
        if not candidates:
            raise FormatError(f"no complete checkpoint of a CheckpointManager in {self.directory}")
        raise FormatError(
            f"no restorable step in {self.directory}: " + "; ".join(f"{src} step {s}: {why}" for src, s, why in refused)
        )

    def _load_global(self, state_dict: dict, step: int) -> Restored:
        rank = LocalLoadRank(self.comm, state_dict, self.directory, self.store, step)
        _, work = rank.run()
        recorded = self._manifest.steps[step].layout
        saved_on = recorded if recorded is not None else JobLayout(work.plan.meta.world_size)
        return Restored({"local": 0, "peer": 0, "global": sum(op.nbytes for op in work.plan.ops)}, saved_on)

    def _layout(self, state_dict: dict) -> JobLayout:
        """This job's layout, with ``state_dict``'s meshes on this rank."""
        return JobLayout(self.comm.size, meshes_of(state_dict), None if self.local is None else self.local.nodes)

    def _refuse(self, refused: list, source: str, step: int, why: str) -> None:
        logger.warning("CheckpointManager: step %d of the %s tier cannot be restored: %s", step, source, why)
        refused.append((source, step, why))

    def _restored(self, step: int, tier: str, got: Restored, refused: list, state_dict: dict) -> int:
        into = self._layout(state_dict)
        self.last_restore = RestoreReport(step, tier, got.bytes, tuple(refused), got.saved_on, into, got.from_lost_nodes)
        logger.info("CheckpointManager: restored step %d from the %s tier (%s), saved on %d ranks, restored into %d%s",
                    step, tier, got.bytes, got.saved_on.world_size, into.world_size,
                    f"; files of lost nodes, from copies: {list(got.from_lost_nodes)}" if got.from_lost_nodes else "")
        return step

    def latest_step(self) -> int | None:
        """The newest complete step (every rank gives the same answer), or None. With a local
        tier, every rank calls it together: the newest step of the global tier, or of the
        local tier with every data file present on some node (whether the bytes verify is
        :meth:`restore`'s to find; it passes over a step whose bytes do not)."""
        steps = set(self._manifest.complete())
        if self.local is not None:
            steps |= self.local.whole_steps()
        return max(steps) if steps else None

    def all_steps(self) -> list[int]:
        """The complete steps the global tier keeps, ascending."""
        return self._manifest.complete()

    def metrics(self, step: int) -> dict | None:
        """The metrics saved with ``step`` (None when none were given)."""
        entry = self._manifest.steps.get(step)
        return None if entry is None or entry.metrics is None else dict(entry.metrics)

    def wait(self) -> None:
        """Wait for the pending async save and its retention; raise the first error."""
        pending, self._pending = self._pending, []
        errors = []
        for handle in pending:
            try:
                handle.wait()
            except BaseException as exc:  # noqa: BLE001 - the first one is raised
                errors.append(exc)
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Wait for the pending save, free the async staging memory, release the directory."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            STATE.staging.release()
            if self._lock_file is not None:
                self._lock_file.close()  # closing the file releases its lock
                self._lock_file = None

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ steps
    def _open(self) -> None:
        """The coordinator takes the directory's lock, reads the manifest and reconciles it with
        the checkpoints present; every rank gets it; leftovers of crashes are removed."""

        def load(_):
            self.store.create()
            self._lock_file = _take_lock(self.directory)
            data = self.store.read_file(MANIFEST_NAME)
            manifest = Manifest() if data is None else Manifest.from_json(data, f"{self.directory}/{MANIFEST_NAME}")
            complete = storage.list_checkpoints(self.store).complete
            for step, entry in manifest.steps.items():
                if entry.state == "writing" and step in complete:  # committed, then a crash
                    manifest = manifest.with_state([step], "complete")
                elif entry.state == "complete" and step not in complete:  # its metadata is gone
                    manifest = manifest.with_state([step], "deleting")
            return manifest, None

        try:
            self._decide(self.comm, "open manager", load, write=False)
            self._retain(self.comm, unfinished_only=True)
            if self.local is not None:
                self.local.open()
        except BaseException:
            self._closed = True
            if self._lock_file is not None:  # released for a manager made again
                self._lock_file.close()
                self._lock_file = None
            raise

    def _retain(self, comm: Comm, unfinished_only: bool = False) -> None:
        protocol.run(comm, self._retention(comm, unfinished_only))

    def _retention(self, comm: Comm, unfinished_only: bool = False) -> protocol.Protocol:
        """Choose the steps to delete (coordinator), mark them, remove their metadata, then
        every rank removes its own data files (on object storage the coordinator removes them
        all: one listing, batched deletes), then they leave the manifest."""

        def choose(manifest: Manifest):
            if unfinished_only:
                doomed = sorted(s for s, e in manifest.steps.items() if e.state != "complete")
            else:
                doomed = to_delete(manifest, self.max_to_keep, self.keep_every_n_steps, self._scores(manifest))
            if not doomed:
                return manifest, []
            manifest = manifest.with_state(doomed, "deleting")
            self.store.write_atomic(MANIFEST_NAME, manifest.to_json())
            for step in doomed:  # no metadata, no checkpoint: from here on it is never loaded
                self.store.remove([metadata_name(step)])
                cleanup.remove_temporary(self.store, step, -1)
            return manifest, doomed

        doomed = yield from self._decision(comm, "retention: choose", choose, False)
        if not doomed:
            return
        def remove() -> None:
            if not self.store.seen_by_all:
                cleanup.remove_steps(self.store, doomed, comm.rank)
            elif comm.rank == comm.coordinator:  # one listing, batched deletes, for every rank
                cleanup.remove_steps(self.store, doomed)

        yield from protocol.local("retention: remove data files", remove)
        yield from self._decision(comm, "retention: forget", lambda m: (m.without(doomed), None), True)
        logger.info("CheckpointManager %s: deleted steps %s", self.directory, doomed)

    def _scores(self, manifest: Manifest) -> dict[int, float | None] | None:
        if self.best_fn is None:
            return None
        return {
            s: None if e.metrics is None else score(self.best_fn(dict(e.metrics)), self.best_mode)
            for s, e in manifest.steps.items()
            if e.state == "complete"
        }

    def _decide(self, comm: Comm, step: str, change, write: bool = True):
        """The coordinator applies ``change(manifest) -> (manifest, value)`` (and writes the
        manifest when ``write``); every rank gets the new manifest and the JSON ``value``, or
        the same CollectiveError: a protocol of one local step and a broadcast, agreed on as a
        save's and a load's steps are."""
        return protocol.run(comm, self._decision(comm, step, change, write))

    def _decision(self, comm: Comm, step: str, change, write: bool) -> protocol.Protocol:
        def apply() -> bytes:
            if not comm.is_coordinator:
                return b""
            manifest, value = change(self._manifest)
            if write:
                self.store.write_atomic(MANIFEST_NAME, manifest.to_json())
            return json.dumps({"manifest": manifest.to_json().decode(), "value": value}).encode()

        data = yield from protocol.local(step, apply)
        doc = json.loads((yield protocol.Broadcast(data, comm.coordinator)))
        self._manifest = Manifest.from_json(doc["manifest"].encode())
        return doc["value"]

    def _check_open(self) -> None:
        if self._closed:
            raise ArgumentError(f"the CheckpointManager of {self.directory} is closed")


def _check_count(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if type(value) is not int or value < 1:
        raise ArgumentError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}")


def _take_lock(directory: str):
    """Hold an exclusive lock on the directory's lock file while the manager is open (the OS
    releases it when the process ends); ArgumentError naming the holder when another manager
    has it. Object storage has no such lock: there, one manager per prefix is the user's job.

    The lock file is never opened through a link, and its content (who holds it) is written
    only into a file this manager created or one that holds nothing but such a line: a file
    planted under its name (a hard link to another file, say) is locked, never truncated."""
    if is_url(directory):
        logger.warning("CheckpointManager: %s cannot be locked; a second manager on it is not detected", directory)
        return None
    import fcntl

    path = os.path.join(directory, LOCK_NAME)
    f = os.fdopen(_open_lock_file(path), "r+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = f.read(200).strip() or "another process"
        f.close()
        raise ArgumentError(
            f"{directory} is in use by another CheckpointManager ({holder!r}); two managers on one "
            f"directory would delete each other's checkpoints: close the other one or use another directory"
        ) from None
    st = os.fstat(f.fileno())
    if st.st_nlink == 1 and st.st_size <= 200 and _LOCK_LINE.fullmatch(f.read(201)):
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
    else:
        logger.warning("CheckpointManager: %s holds something other than a lock line; locked, left as it is", path)
    return f


_LOCK_LINE = re.compile(r"(?:pid [0-9]+ on [^\n]{0,150}\n)?")


def _open_lock_file(path: str) -> int:
    """The lock file, created if need be, never through a link; a StorageError when it is not
    a regular file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as exc:
        raise StorageError(f"cannot open the manager's lock file {path}: {exc}", path) from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise StorageError(f"the manager's lock file {path} is not a regular file: refused", path)
    return fd