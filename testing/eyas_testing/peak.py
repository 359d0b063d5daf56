"""The most bytes a dataset folder's shards held at once, sampled in a thread (streaming tests and bench)."""

from __future__ import annotations

import threading
import time
from pathlib import Path


class PeakBytes(threading.Thread):
    """`with PeakBytes(folder) as peak: ...` then `peak.peak`: the largest total size of the folder's
    `shard-*` files (final or being written) seen, sampled every 5 ms."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path, self.peak, self.halt = Path(path), 0, threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            size = 0
            for p in self.path.glob("shard-*") if self.path.is_dir() else []:
                try:
                    size += p.stat().st_size
                except FileNotFoundError:  # consumed or renamed meanwhile
                    pass
            self.peak = max(self.peak, size)
            time.sleep(0.005)

    def __enter__(self) -> "PeakBytes":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.halt.set()
        self.join()
