"""Training batches made ahead by worker processes, so that mixing keeps up with a fast device.

Example `i` of the stream is a pure function of (seed, i) (`training.data.synthesis`), so the workers may make
the examples of future steps in any order: batch k of a process holds the examples
`first + k * stride ... + batch_size`, exactly those the trainer would have made itself, and a run
with workers sees the same data as one without them (`tests/training/test_feeder.py`).

The workers are forked from the trainer before it touches CUDA and share the decoded audio
(memory-mapped caches or the in-memory copy of `fit --shards`) copy-on-write.
"""
from __future__ import annotations

import math
import multiprocessing as mp
from collections import deque

import numpy as np

_SYNTH = None  # the worker's Synthesizer, inherited through fork


def _make(lo: int, hi: int):
    return _SYNTH.batch(range(lo, hi))


class BatchFeeder:
    """`next()` -> (noisy, clean, bandwidth_hz) of the next batch, as `Synthesizer.batch` would give."""

    def __init__(self, synth, batch_size: int, stride: int, first: int, workers: int, depth: int | None = None):
        global _SYNTH
        if workers < 1:
            raise ValueError("a feeder needs at least one worker")
        self.synth, self.batch_size, self.stride = synth, int(batch_size), int(stride)
        self.next_first = int(first)  # the first example of the next batch to submit
        self.chunk = max(1, math.ceil(self.batch_size / workers))
        self.depth = depth or max(2, math.ceil(2 * workers / math.ceil(self.batch_size / self.chunk)))
        _SYNTH = synth
        self.pool = mp.get_context("fork").Pool(workers)
        self.queue: deque = deque()
        for _ in range(self.depth):
            self._submit()

    def _submit(self) -> None:
        lo = self.next_first
        parts = [self.pool.apply_async(_make, (a, min(a + self.chunk, lo + self.batch_size)))
                 for a in range(lo, lo + self.batch_size, self.chunk)]
        self.queue.append((lo, parts))
        self.next_first += self.stride

    def next(self, first: int | None = None):
        """The next batch. `first`, its first example, re-plans the queue when it differs from the
        plan (a resumed run: the pool is forked before the trainer knows where it resumes)."""
        if first is not None and self.queue and self.queue[0][0] != first:
            self.queue.clear()  # the planned results are dropped unread
            self.next_first = int(first)
            for _ in range(self.depth):
                self._submit()
        _lo, parts = self.queue.popleft()
        self._submit()
        got = [p.get() for p in parts]
        return tuple(np.concatenate([g[j] for g in got]) for j in range(3))

    def close(self) -> None:
        """Let the workers finish the batches already asked for, then exit. (`Pool.terminate` can
        deadlock on the task queue's lock when it races a worker that is taking a task.)"""
        self.queue.clear()
        self.pool.close()
        self.pool.join()
