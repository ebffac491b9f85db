"""Training batches made ahead by worker processes, so that mixing keeps up with a fast device.

Example `i` of the stream is a pure function of (seed, i) (`training.data.synthesis`), so the workers may make
the examples of future steps in any order: batch k of a process holds the examples
`first + k * stride ... + batch_size`, exactly those the trainer would have made itself, and a run
with workers sees the same data as one without them (`tests/training/test_shards.py`).

The workers are forked from the trainer before it touches CUDA and share the decoded audio
(memory-mapped caches or the in-memory copy of `fit --shards`) copy-on-write. They write each
example straight into a ring of batch slots in shared memory (an anonymous shared mapping made
before the fork) and send back only that it is done: the trainer receives no pickled audio and
copies nothing on the host, so a batch costs its process almost no CPU (`enhancer-train bench-fit
--data-workers N` measures it) and the trainer's core is left to drive the device.
"""
from __future__ import annotations

import math
import mmap
import multiprocessing as mp
from collections import deque

import numpy as np

_SYNTH = None  # the worker's Synthesizer, inherited through fork
_SLOTS = None  # (noisy (S, B, N), clean (S, B, N), bandwidth_hz (S, B)): the shared ring, inherited through fork


def _make(slot: int, row: int, lo: int, hi: int) -> None:
    noisy, clean, bw = _SLOTS
    for j, i in enumerate(range(lo, hi)):
        e = _SYNTH.example(i)
        noisy[slot, row + j], clean[slot, row + j], bw[slot, row + j] = e.noisy, e.clean, e.bandwidth_hz


class BatchFeeder:
    """`next()` -> (noisy, clean, bandwidth_hz) of the next batch, as `Synthesizer.batch` would give.

    The arrays are views of a shared slot, valid until the following `next()`: copy them (to the
    device, or with `np.array`) before asking for another batch."""

    def __init__(self, synth, batch_size: int, stride: int, first: int, workers: int, depth: int | None = None):
        global _SYNTH, _SLOTS
        if workers < 1:
            raise ValueError("a feeder needs at least one worker")
        self.synth, self.batch_size, self.stride = synth, int(batch_size), int(stride)
        self.next_first = int(first)  # the first example of the next batch to submit
        self.chunk = max(1, math.ceil(self.batch_size / workers))
        self.depth = depth or max(2, math.ceil(2 * workers / math.ceil(self.batch_size / self.chunk)))
        # depth batches in flight and the one the caller holds: a slot is refilled only after the
        # caller asked for the batch after it
        self.n_slots = self.depth + 1
        b, n = self.batch_size, synth.cfg.segment_samples
        self._mem = mmap.mmap(-1, self.n_slots * (2 * b * n + b) * 4)  # anonymous and shared with the forks
        flat = np.frombuffer(self._mem, np.float32)
        audio = flat[: 2 * self.n_slots * b * n].reshape(2, self.n_slots, b, n)
        self.slots = (audio[0], audio[1], flat[2 * self.n_slots * b * n:].reshape(self.n_slots, b))
        _SYNTH, _SLOTS = synth, self.slots
        self.pool = mp.get_context("fork").Pool(workers)
        self.submitted = 0  # batches submitted so far; batch j fills slot j % n_slots
        self.queue: deque = deque()
        for _ in range(self.depth):
            self._submit()

    def _submit(self) -> None:
        lo, slot = self.next_first, self.submitted % self.n_slots
        parts = [self.pool.apply_async(_make, (slot, a - lo, a, min(a + self.chunk, lo + self.batch_size)))
                 for a in range(lo, lo + self.batch_size, self.chunk)]
        self.queue.append((lo, slot, parts))
        self.next_first += self.stride
        self.submitted += 1

    def next(self, first: int | None = None):
        """The next batch. `first`, its first example, re-plans the queue when it differs from the
        plan (a resumed run: the pool is forked before the trainer knows where it resumes)."""
        if first is not None and self.queue and self.queue[0][0] != first:
            for _lo, _slot, parts in self.queue:  # the planned batches are dropped unread, once they
                for p in parts:                   # no longer write into slots the new plan reuses
                    p.wait()
            self.queue.clear()
            self.next_first = int(first)
            for _ in range(self.depth):
                self._submit()
        _lo, slot, parts = self.queue.popleft()
        self._submit()
        for p in parts:
            p.get()  # a worker's exception is raised here
        return tuple(a[slot] for a in self.slots)

    def close(self) -> None:
        """Let the workers finish the batches already asked for, then exit. (`Pool.terminate` can
        deadlock on the task queue's lock when it races a worker that is taking a task.)"""
        self.queue.clear()
        self.pool.close()
        self.pool.join()
