"""The writer lock of a dataset: one writer at a time, named to whoever else tries.

`<root>/<kind>/.<name>[.<part>].lock` holds the holder's host, pid, start time and command line as
JSON, and the holder keeps an exclusive `flock` on it for as long as it writes. The kernel drops that
flock when the holder dies however it dies (kill -9, OOM, power loss of a client), so a lock can never
stay stuck: a later writer finds the flock free, logs that it takes over from the holder named in the
file, and writes its own name. A live holder's lock refuses the second writer with the holder's name.
The file itself is never deleted while in use (a deleted lock file would let two writers hold two
different inodes); a clean release empties it. Only `eyas-data rm` deletes it, holding its flock, with the
dataset (held_for_removal); a writer that opened it just before finds it unlinked and locks the new one.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from eyas_common.contract import Dataset, DatasetError, folder_bytes, human_bytes, lock_file, now_iso


# A follower (extract of synth, train of hidden) calls a partial dataset stopped only once no writer has held
# it for this long: a rerun's writer (make pipeline starts all stages at once) takes its lock after its imports.
WRITER_GRACE_S = 30.0


class WriterWatch:
    """`gone(holder)`: whether a followed dataset's writer has been absent for WRITER_GRACE_S in a row."""

    def __init__(self) -> None:
        self.absent_since: float | None = None

    def gone(self, holder: dict[str, Any] | None) -> bool:
        if holder is not None:
            self.absent_since = None
            return False
        self.absent_since = self.absent_since or time.monotonic()
        return time.monotonic() - self.absent_since >= WRITER_GRACE_S


class WriterLock:
    """`with WriterLock(ds, stage="01_synth"):` around everything that writes into `ds`.

    `part` separates writers that may run side by side on one dataset by design (extract's
    `--shard I/N` parts and torchrun ranks each take their own part's lock).
    """

    def __init__(self, ds: Dataset, *, stage: str, part: str = "") -> None:
        self.ds, self.stage, self.part = ds, stage, part
        self.path = lock_file(ds, part)
        self._fd: int | None = None
        self.took_over: dict[str, Any] | None = None

    def _open_locked(self) -> int:
        """The lock file, opened with our exclusive flock on it; refused, naming the holder, while one holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd)
                os.close(fd)
                what = f" part {self.part}" if self.part else ""
                raise DatasetError(
                    f"{self.ds.ref}{what} is being written by {describe(holder)} (lock {self.path}); wait for it to "
                    f"end or stop it, or pick another --name. A crashed writer's lock is taken over on its own"
                ) from None
            if os.fstat(fd).st_nlink:
                return fd
            os.close(fd)  # deleted with its dataset (eyas-data rm) between our open and flock: lock the new one

    def acquire(self) -> "WriterLock":
        fd = self._open_locked()
        previous = _read(fd)
        if previous:  # not released cleanly: its holder died while writing
            self.took_over = previous
            print(f"[eyas] {self.ds.ref}: taking over the writer lock left by {describe(previous)}, "
                  f"which is no longer running (its partial output is checked on resume)", file=sys.stderr)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": now_iso(), "stage": self.stage,
              "argv": sys.argv}
        self._fd = fd
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
            os.fsync(fd)
        except BaseException:
            # Ctrl-C or SIGTERM while the record is written (the `with` body never starts, so its exit never
            # runs): release here, or the next writer would take the record for a crashed holder's
            self.release()
            raise
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)  # empty = released cleanly; the next writer has nothing to take over
        except OSError:
            pass
        os.close(self._fd)  # closing drops the flock
        self._fd = None

    def __enter__(self) -> "WriterLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def holder(ds: Dataset, part: str = "") -> dict[str, Any] | None:
    """Who writes `ds` now: the lock's record while a live process holds its flock, None when nobody does
    (never written, released, or its holder died: the kernel dropped the flock). Writes nothing.

    Asked with a shared flock taken and dropped at once, so a writer starting in that instant could be
    refused as if a second writer held the lock; it is microseconds, and its rerun goes through.
    """
    try:
        fd = os.open(lock_file(ds, part), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            # held; between its flock and its pwrite the record may still be empty
            return _read(fd) or {"host": "?", "pid": "?", "started": "?"}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


# The one kind of part: worker W of a split over N (extract's --shard parts x torchrun ranks).
WORKER_PART = re.compile(r"worker-(\d+)-of-(\d+)")


def worker_part(worker: int, workers: int) -> str:
    return f"worker-{worker}-of-{workers}"


def lock_parts(ds: Dataset) -> list[str]:
    """The parts of `ds` whose lock files there are ("" for its own lock). Matched exactly, not by prefix: a
    name may hold dots, and dataset `a` must not take `.a.b.lock` (dataset a.b's) for one of its own."""
    prefix, found = f".{ds.name}.", []
    for path in sorted(lock_file(ds).parent.glob(f"{prefix}*lock")):
        part = path.name[len(prefix):-len(".lock")] if path.name != f"{prefix}lock" else ""
        if not part or WORKER_PART.fullmatch(part):
            found.append(part)
    return found


def any_holder(ds: Dataset) -> dict[str, Any] | None:
    """Who writes `ds` now under any part's lock (extract's workers each hold their own), or None."""
    for part in lock_parts(ds):
        if (h := holder(ds, part)) is not None:
            return h
    return None


def _removal_refused(ds: Dataset, holder: dict[str, Any] | None) -> DatasetError:
    return DatasetError(f"{ds.ref} is being written by {describe(holder)}; stop it first, then rerun "
                        f"`eyas-data rm {ds.ref}`")


def refuse_if_written(ds: Dataset) -> None:
    """Refuse to delete `ds` while a live writer holds any of its locks (a dead writer's does not count)."""
    if (h := any_holder(ds)) is not None:
        raise _removal_refused(ds, h)


@contextmanager
def held_for_removal(ds: Dataset) -> Iterator[None]:
    """Hold every writer lock of `ds` while the caller deletes its folder, then delete the lock files: no writer
    can start meanwhile. Refused, naming the holder, while a live writer holds any of them."""
    paths = sorted({lock_file(ds), *(lock_file(ds, part) for part in lock_parts(ds))})
    fds: list[int] = []
    try:
        for path in paths:
            fds.append(os.open(path, os.O_RDWR | os.O_CREAT, 0o644))
            try:
                fcntl.flock(fds[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise _removal_refused(ds, _read(fds[-1])) from None
        yield
        for path in paths:  # still held: a writer that opened one meanwhile finds it unlinked (_open_locked)
            path.unlink(missing_ok=True)
    finally:
        for fd in fds:
            os.close(fd)


def _read(fd: int) -> dict[str, Any] | None:
    try:
        raw = os.pread(fd, 65536, 0)
        return json.loads(raw) if raw.strip() else None
    except (OSError, ValueError):
        return {"host": "?", "pid": "?", "started": "?"}


def describe(holder: dict[str, Any] | None) -> str:
    h = holder or {}
    return f"{h.get('stage', 'a writer')} pid {h.get('pid', '?')} on host {h.get('host', '?')} since {h.get('started', '?')}"


def remove(ds: Dataset, *, dry_run: bool = False) -> str:
    """Delete a dataset folder (only say what would go when `dry_run`); a symlink in its place is unlinked,
    never followed; anything else that is not a dataset folder inside the data root is refused, and so is a
    dataset a live writer holds (a dead writer's lock does not count)."""
    if ds.path.is_symlink():
        # A link (e.g. an alias of another dataset): the link goes, whatever it points to stays.
        refuse_if_written(ds)
        points_to = os.readlink(ds.path)
        if dry_run:
            return f"would delete the link {ds.path} (its target {points_to} is kept); nothing deleted (dry run)"
        ds.path.unlink()
        return f"deleted the link {ds.path}; its target {points_to} is kept"
    if not ds.path.is_dir():
        raise DatasetError(f"{ds.ref}: {ds.path} is a file, not a dataset folder; remove it by hand if it is yours")
    root = ds.root.resolve()
    target = ds.path.resolve()
    if target.parent.parent != root:
        raise DatasetError(f"refusing to delete {target}: it is not a dataset folder inside the data root {root}")
    if dry_run:
        refuse_if_written(ds)
        return f"would delete {target} ({human_bytes(folder_bytes(target))}); nothing deleted (dry run)"
    with held_for_removal(ds):  # no writer starts while its folder goes
        shutil.rmtree(target)
    return f"deleted {target}"
