"""Stage 03's heap trimmer on a real glibc heap: a fragmented heap is handed back once, a tidy one is left alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from eyas_train.hostmem import HeapTrimmer

# Run in a fresh interpreter: its heap holds only what the script allocates, whatever the tests before it did.
SCRIPT = r"""
import json, random, torch
from eyas_train.hostmem import HeapTrimmer, resident_anon
MiB = 2**20
heap = HeapTrimmer(min_gap=128 * MiB)
random.seed(0)
log = {}
# glibc mmaps blocks over its threshold (128 KiB at first) and raises the threshold to the size of each mmapped
# block freed: after a training's first steps its tensors come from the heap. Free one 2.4 MB block to get there.
torch.ones(600_000).sum()  # made and freed at once
live = [torch.ones(random.randint(25_000, 500_000)) for _ in range(600)]  # 0.1-2 MB each, ~600 MB
log["tidy"] = heap.after_step()          # all of it in use: no gap
kept = live[::9]
del live                                  # 8 blocks of 9 freed, in between the kept ones: a fragmented heap
log["before"] = resident_anon() // MiB
log["freed"] = heap.after_step() // MiB
log["after"] = resident_anon() // MiB
log["again"] = heap.after_step()          # the gap is gone: no second trim
log["kept_sum_ok"] = all(float(t.sum()) == t.numel() for t in kept)
log["summary"] = heap.summary()
# memory malloc does not own (an anonymous mmap, as pymalloc's arenas or a CUDA driver's): one trim finds it
# cannot give it back, and no later step trims for it again
import mmap
other = mmap.mmap(-1, 400 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: RssAnon
other.write(b"x" * (400 * MiB))
trims = heap.trims
log["not_mallocs"] = [heap.after_step() // MiB for _ in range(3)]
log["not_mallocs_trims"] = heap.trims - trims
print(json.dumps(log))
"""


@pytest.mark.skipif(HeapTrimmer().libc is None, reason="glibc with mallinfo2 (2.33+) only")
def test_a_fragmented_heap_is_given_back_once_and_live_tensors_are_untouched():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    log = json.loads(out.stdout.strip().splitlines()[-1])
    assert log["tidy"] == 0 and log["again"] == 0
    assert log["freed"] > 300, log  # ~530 MB of the 600 were freed between live blocks
    assert log["after"] < log["before"] - 300, log
    assert log["kept_sum_ok"]
    assert log["summary"].startswith("gave freed host memory back to the system once")
    assert log["not_mallocs"][0] < 50 and log["not_mallocs"][1:] == [0, 0] and log["not_mallocs_trims"] == 1, log
