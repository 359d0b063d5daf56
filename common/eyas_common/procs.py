"""Process conventions shared by the stages: torchrun's environment, and what SIGTERM does.

SIGTERM (docker stop, kill, a scheduler's preemption) is handled exactly like Ctrl-C in synth,
extract, train and serve's bench: it raises KeyboardInterrupt in the main thread, each stage keeps
what it has finished (samples flushed, shards committed, the last checkpoint; a bench stays partial),
prints how to resume, and exits with status 130.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, TypeVar

from eyas_common.contract import DatasetError

T = TypeVar("T")


class Ranks(NamedTuple):
    rank: int
    world: int
    local_rank: int


def torchrun_ranks() -> Ranks:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) outside torchrun."""
    env = os.environ
    try:
        r = Ranks(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))
    except ValueError:
        raise DatasetError(f"RANK={env.get('RANK')!r} WORLD_SIZE={env.get('WORLD_SIZE')!r} LOCAL_RANK="
                           f"{env.get('LOCAL_RANK')!r}: expected integers (torchrun sets them); unset them to "
                           f"run one process") from None
    if r.world < 1 or not 0 <= r.rank < r.world or r.local_rank < 0:
        raise DatasetError(f"RANK={r.rank} WORLD_SIZE={r.world} LOCAL_RANK={r.local_rank}: need 0 <= RANK < "
                           f"WORLD_SIZE; unset them to run one process")
    return r


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside: SIGTERM raises KeyboardInterrupt, like Ctrl-C (main thread only; a no-op elsewhere)."""
    try:
        old = signal.signal(signal.SIGTERM, _interrupt)
    except ValueError:  # not the main thread: signals cannot be handled here
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def run_interruptible(aw: Awaitable[T]) -> T:
    """`asyncio.run(aw)` where SIGTERM cancels the main task inside the loop, as asyncio does for Ctrl-C;
    both end here as KeyboardInterrupt once every task has been cancelled. (A KeyboardInterrupt raised by a
    plain signal handler lands inside whichever task runs, and asyncio then prints that task's traceback.)"""
    stopped = False
    previous = signal.getsignal(signal.SIGTERM)

    async def main() -> T:
        task = asyncio.current_task()

        def stop() -> None:
            nonlocal stopped
            stopped = True
            task.cancel()

        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop)
        except (ValueError, RuntimeError):  # not the main thread: signals cannot be handled here
            pass
        return await aw

    try:
        return asyncio.run(main())
    except asyncio.CancelledError:
        if stopped:
            raise KeyboardInterrupt from None
        raise
    finally:
        if previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)  # the closed loop left SIGTERM at its default: kill
