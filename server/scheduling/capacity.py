"""Measured capacity: how many live streams each worker can step within the hop, on this machine.

At start-up, before the service turns ready, every worker times its own batched step
(`LanePool.step`) at growing batch sizes, all workers at once (so that they compete for the cores
and the memory bandwidth as they do when serving), each step paced at the 16 ms hop as live audio
paces it (a step back to back with the previous one finds the weights in the caches and looks
cheaper than it is).

The event loop works for every live stream too (receiving, decoding, resampling and sending its
audio: `loop_ms` of the calibrating thread's CPU per stream and hop, about 0.2 ms), holding the
interpreter lock for much of it. While the workers are timed, the calibrating thread reproduces that
work for the lanes they step, spread over the hop as the streams' messages arrive, so the steps are
timed against the contention they meet when serving.

The capacity follows from robust statistics of all the workers' steps together (the workers are
alike: threads of one process on like cores, so each gets the same capacity). Per batch size, the
median step; over all sizes, the tail factor `p95 / median` of the steps (every step divided by its
size's median, pooled), which says how far the slow steps stray. A step costs about `a + c x batch`:
the line is fitted to the medians (least squares; sizes stretched past the hop by waiting for a
core are left out), and a worker's capacity is the largest batch whose step on that line, times
the tail factor, stays within the step budget, `hop x (1 - capacity_margin)` (never more than the
largest size timed). The margin is left for the batch wait, the workers' own bookkeeping and
catching up after a stall (streams that fall behind catch up together: `server.scheduling.batcher`). A single slow step (a preemption of the
virtual machine) moves neither the medians nor the tail factor much, so one start-up measures about
what the next does.

Calibration times each batch size up to the first whose median is over the budget (a sweep), then
times those sizes in turn, a few steps at a time, so that a second in which the machine is slower
weighs on all of them alike: about 6 s, bounded by `deadline_s`. `Settings.capacity` replaces it with a fixed
number (tests, or an operator who measured the machine with `python -m tools.loadtest`).

While serving, a measured capacity follows the machine (`CapacityTracker`): every second each
worker's step timings (its live batched steps, or the probe steps an idle worker times) are
reduced to a p95 cost per lane-equivalent, `step / (overhead + batch)` (a step costs about
`c x (overhead + batch)`, the overhead fitted to the calibration's medians), from which the lanes that fit
the step budget follow. A worker's capacity is raised when that projection leaves `RAISE_HEADROOM`
of the budget free for `raise_after_s` on end, lowered when it overruns the budget for
`lower_after_s`, never below the lanes its admitted streams hold.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger("tim_enhancer.server")

BATCHES = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
REPS = 32  # paced steps timed per batch size and worker, in blocks of BLOCK, the sizes in turn
BLOCK = 8
COARSE_REPS = 12  # paced steps per size in the sweep that finds the sizes
TAIL_QUANTILE = 95  # the tail factor: this percentile of the steps over their size's median ...
TAIL_MIN_BATCH = 4  # ... in batches of this many lanes or more
WARMUP = 3  # steps per batch size before timing (onnxruntime plans each new shape once)
# following the machine while serving (CapacityTracker)
TICK_S = 1.0  # how often the capacity is re-estimated
MIN_SAMPLES = 3  # steps a worker must have timed within a tick for the tick to count
RAISE_HEADROOM = 0.1  # a raise needs the projected p95 within budget x (1 - this): a dead band against flapping
STALE_S = 3 * TICK_S  # a streak of ticks with a gap longer than this (no steps timed) starts again
DEFAULT_OVERHEAD_LANES = 4.0  # a step's fixed cost in lanes' worth when the calibration cannot tell
PROBE_LANES = 8  # an idle worker's probe steps this many lanes at most (its capacity, if smaller)
PROBE_INTERVAL_S = 0.25  # ... this often


@dataclass(frozen=True)
class WorkerCapacity:
    """One worker's calibration: its step durations (s) per batch size timed, and the p99 (ms) of each."""

    durations: dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def step_p99_ms(self) -> dict[int, float]:  # shown in /readyz beside the pooled medians
        return {b: 1000 * float(np.percentile(d, 99)) for b, d in self.durations.items()}


@dataclass(frozen=True)
class Capacity:
    """Live streams (mono: one lane each) the service admits, and how the figure was obtained."""

    streams: int  # admitted live lanes over all workers: min(sum of the workers', max_streams)
    per_worker: tuple[int, ...]
    calibrated: bool  # False: a fixed number from the settings
    budget_ms: float  # step allowed (median x tail factor; p95 while serving): hop x (1 - margin)
    margin: float
    step_p99_ms: tuple[dict, ...] = ()  # per worker: batch -> p99 (ms), as timed
    seconds: float = 0.0  # how long the calibration took
    loop_ms: float = 0.0  # the event loop's work per stream and hop reproduced while calibrating
    step_p50_ms: dict = field(default_factory=dict)  # all workers' steps: batch -> median (ms)
    tail: float = 1.0  # p95 / median of the steps (TAIL_QUANTILE)

    def public(self) -> dict:
        return {"streams": self.streams, "per_worker": list(self.per_worker), "calibrated": self.calibrated,
                "step_budget_ms": round(self.budget_ms, 2), "margin": self.margin,
                "step_p50_ms": {str(b): round(ms, 2) for b, ms in self.step_p50_ms.items()},
                "tail_factor": round(self.tail, 3),
                "step_p99_ms": [{str(b): round(ms, 2) for b, ms in d.items()} for d in self.step_p99_ms],
                "calibration_s": round(self.seconds, 2), "calibration_loop_ms": self.loop_ms}


def fixed(streams: int, workers: int, max_streams: int, hop_s: float, margin: float) -> Capacity:
    """`streams` (capped at `max_streams`) spread over the workers, no measurement."""
    total = min(streams, max_streams)
    per = [total // workers + (i < total % workers) for i in range(workers)]
    # a worker may hold more than its share when another is empty: admission also checks the total
    return Capacity(total, tuple(max(p, 1) if total else 0 for p in per), False, 1000 * hop_s * (1 - margin), margin)


def warm(pools, lanes: Sequence[int], hop_s: float, steps: int = WARMUP) -> None:
    """Before a fixed capacity is served: every pool steps its first `lanes[i]` lanes (at least one)
    `steps` times, paced at the hop, then resets them, so that the first streams meet memory
    already mapped and an inference session that has run (a fresh process's first steps and first
    writes into its key/value rings take tens of milliseconds, which would make its first stream
    late). Calibration does the same as a side effect."""
    rng = np.random.default_rng(0)
    for pool, n in zip(pools, lanes):
        n = max(1, min(int(n), pool.capacity))
        time_steps(pool, n, 1, hop_s, rng, warmup=steps)


def lanes_within(points: dict[int, float], budget_ms: float) -> int:
    """The largest batch whose step (interpolated between measured sizes, made monotonic) is within
    `budget_ms`; the largest measured size if all are within, 0 if none is."""
    sizes = sorted(points)
    envelope = np.maximum.accumulate([points[b] for b in sizes])
    best = 0
    for i, (b, p) in enumerate(zip(sizes, envelope)):
        if p > budget_ms:
            if i > 0:  # interpolate between the last size within the budget and this one
                b0, p0 = sizes[i - 1], envelope[i - 1]
                best = int(b0 + (budget_ms - p0) * (b - b0) / max(p - p0, 1e-9))
            return best
        best = b
    return best


def time_steps(pool, batch: int, reps: int, hop_s: float, rng: np.random.Generator,
               stepping: list | None = None, slot: int = 0, warmup: int = WARMUP) -> np.ndarray:
    """Durations (s) of `reps` steps of `batch` lanes (allocated from the pool, given back after),
    one per hop, after `warmup` untimed ones; `stepping[slot]` says the batch while it is timed (the
    event loop's emulation reads it)."""
    lanes = pool.alloc(batch)
    hop = pool.engine.config.stft.hop
    gains = np.ones(batch, np.float32)
    hops = (0.05 * rng.standard_normal((batch, hop))).astype(np.float32)
    for _ in range(warmup):
        pool.step(lanes, hops, gains)
    if stepping is not None:
        stepping[slot] = batch
    out = np.empty(reps)
    tick = time.perf_counter()
    for k in range(reps):
        t0 = time.perf_counter()
        pool.step(lanes, hops, gains)
        t1 = time.perf_counter()
        out[k] = t1 - t0
        tick += hop_s
        if tick > t1:
            time.sleep(tick - t1)
        else:
            tick = t1
    if stepping is not None:
        stepping[slot] = 0
    pool.reset(lanes)  # as a new stream finds them
    pool.free(lanes)
    return out


def _busy(seconds: float) -> None:
    """Hold the interpreter (and a core) for `seconds` of this thread's CPU time, as Python code does."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def emulate_loop(stepping: list, loop_s: float, hop_s: float, done: threading.Event) -> list[int]:
    """Until `done`: each hop, `loop_s` of work per lane being stepped (`sum(stepping)`), one stream's
    share at a time, spread evenly over the hop. Returns the lanes of every hop it ran (a hop it fell
    behind on by more than one hop is skipped, as a late event loop would)."""
    tick = time.perf_counter()
    ran = []
    while not done.is_set():
        lanes = sum(stepping)
        ran.append(lanes)
        for k in range(max(lanes, 1)):
            if lanes:
                _busy(loop_s)
            wait = tick + (k + 1) * hop_s / max(lanes, 1) - time.perf_counter()
            if wait > 0:
                done.wait(wait)
        tick = max(tick + hop_s, time.perf_counter() - hop_s)
    return ran


def calibrate_pool(pool, hop_s: float, budget_s: float, max_lanes: int, deadline: float, reps: int = REPS,
                   seed: int = 0, stepping: list | None = None) -> WorkerCapacity:
    """Step durations of one worker by batch size. First a sweep (`COARSE_REPS` steps per size) up to the
    first size whose median is over the budget (or `max_lanes`, or half the time to the deadline) finds
    the sizes; then those sizes are timed in turn, `BLOCK` steps at a time, until each has `reps` (or
    the deadline): a machine that is slower for a second slows every size a little instead of one size
    much, so the medians lie on one line."""
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    sweep_end = start + (deadline - start) / 2
    sizes: list[int] = []
    for b in [b for b in BATCHES if b < max_lanes] + [max_lanes]:
        if sizes and time.perf_counter() > sweep_end:
            break
        sizes.append(b)
        if np.median(time_steps(pool, b, COARSE_REPS, hop_s, rng, stepping, seed)) > budget_s:
            break
    timed: dict[int, list[np.ndarray]] = {b: [] for b in sizes}
    for _ in range(math.ceil(reps / BLOCK)):
        for b in sizes:
            timed[b].append(time_steps(pool, b, BLOCK, hop_s, rng, stepping, seed, warmup=1))
        if time.perf_counter() > deadline:
            break
    return WorkerCapacity({b: np.concatenate(d) for b, d in timed.items()})


def pooled(results: Sequence[WorkerCapacity]) -> tuple[dict[int, float], float]:
    """All workers' steps together -> (median ms per batch size, tail factor). The tail factor is the
    TAIL_QUANTILE of every step over its size's median (>= 1), from the sizes of TAIL_MIN_BATCH lanes
    and more where there are any: at one or two lanes a wake-up of the core weighs more than it does in
    a step of the batches served."""
    sizes = sorted(set().union(*(r.durations for r in results)))
    medians, ratios = {}, {}
    for b in sizes:
        d = np.concatenate([r.durations[b] for r in results if b in r.durations])
        m = float(np.median(d))
        medians[b] = 1000 * m
        ratios[b] = d / max(m, 1e-9)
    tail_sizes = [b for b in sizes if b >= TAIL_MIN_BATCH] or sizes
    tail = float(np.percentile(np.concatenate([ratios[b] for b in tail_sizes]), TAIL_QUANTILE)) if sizes else 1.0
    return medians, max(tail, 1.0)


def step_line(points: dict[int, float]) -> tuple[float, float] | None:
    """(a, c) of the line `step = a + c x batch` fitted (least squares) to `points` (batch -> ms), or
    None when fewer than two sizes were timed or the line does not rise."""
    sizes = sorted(b for b in points if b >= 1)
    if len(sizes) < 2:
        return None
    c, a = np.polyfit(np.array(sizes, float), np.array([points[b] for b in sizes], float), 1)
    return (float(a), float(c)) if c > 0 else None


def lanes_on_line(medians: dict[int, float], tail: float, budget_ms: float, hop_ms: float | None = None) -> int:
    """Lanes whose step, on the line `a + c x batch` fitted to the medians (`step_line`) and times the
    tail factor, is within `budget_ms`, never more than the largest size timed; with fewer than two
    sizes or a line that does not rise, the measured medians themselves (`lanes_within`).

    Sizes whose median is longer than the hop (`hop_ms`) are left out of the fit when two or more
    others remain: such a worker steps back to back and waits for a core that the other workers and
    the event loop hold, so its step is stretched by the wait, not by its lanes."""
    within = {b: m for b, m in medians.items() if hop_ms is None or m <= hop_ms}
    line = step_line(within if len(within) >= 2 else medians)
    if line is None:
        return lanes_within({b: tail * m for b, m in medians.items()}, budget_ms)
    a, c = line
    return int(min(max(math.floor((budget_ms / tail - a) / c + 1e-9), 0), max(medians)))


def calibrate(pools, hop_s: float, margin: float, max_streams: int, deadline_s: float = 8.0,
              reps: int = REPS, loop_ms: float = 0.0) -> Capacity:
    """Time every pool's step at once (one thread each, as the workers run) while this thread does the
    event loop's `loop_ms` per stream and hop, and derive the capacity."""
    budget_s = hop_s * (1 - margin)
    t0 = time.perf_counter()
    deadline = t0 + deadline_s
    results: list[WorkerCapacity | BaseException | None] = [None] * len(pools)
    barrier = threading.Barrier(len(pools))
    stepping = [0] * len(pools)  # the batch each worker is timing now

    def run(i: int, pool) -> None:
        try:
            barrier.wait()
            results[i] = calibrate_pool(pool, hop_s, budget_s, min(max_streams, pool.capacity), deadline, reps,
                                        seed=i, stepping=stepping)
        except BaseException as e:  # re-raised on the calling thread
            results[i] = e

    threads = [threading.Thread(target=run, args=(i, p), name=f"tim-calibrate-{i}") for i, p in enumerate(pools)]
    for t in threads:
        t.start()
    done = threading.Event()
    waiter = threading.Thread(target=lambda: ([t.join() for t in threads], done.set()), name="tim-calibrate-wait")
    waiter.start()
    if loop_ms > 0:
        emulate_loop(stepping, loop_ms / 1000, hop_s, done)
    waiter.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    medians, tail = pooled(results)
    lanes = min(lanes_on_line(medians, tail, 1000 * budget_s, 1000 * hop_s), min(max_streams, min(p.capacity for p in pools)))
    per = [lanes] * len(results)
    total = min(sum(per), max_streams)
    if total == 0:
        log.warning("calibration: even a step of one stream (median %.1f ms x tail factor %.2f) is over the %.1f ms "
                    "budget; admitting one stream anyway (lower capacity_margin, add cores or set a fixed capacity)",
                    medians.get(1, float("nan")), tail, 1000 * budget_s)
        per, total = [1] + [0] * (len(per) - 1), 1
    cap = Capacity(total, tuple(per), True, 1000 * budget_s, margin, tuple(r.step_p99_ms for r in results),
                   time.perf_counter() - t0, loop_ms, medians, tail)
    log.info("capacity: %d live stream(s) (per worker %s; step budget %.1f ms = hop x (1 - %.2f)), measured in "
             "%.1f s with the event loop's %.2f ms per stream and hop; step median by batch: %s; tail factor "
             "(p%d / median) %.2f", cap.streams, list(per), cap.budget_ms, margin, cap.seconds, loop_ms,
             ", ".join(f"{b}: {ms:.1f}" for b, ms in medians.items()), TAIL_QUANTILE, tail)
    return cap


def overhead_lanes(points: dict[int, float]) -> float:
    """The fixed cost of a step in lanes' worth, `a / c` of the calibration's `step_line`;
    `DEFAULT_OVERHEAD_LANES` when it has none. A negative intercept (costs growing faster than the
    batch) counts 0."""
    line = step_line(points)
    if line is None:
        return DEFAULT_OVERHEAD_LANES
    a, c = line
    return float(min(max(a, 0.0) / c, 64.0))


@dataclass
class Streak:
    """Ticks in a row on which a worker's estimate stayed on one side of its capacity."""

    since: float | None = None  # the first tick's time
    last: float = 0.0
    ticks: int = 0
    bound: int = 0  # raise: the smallest estimate of the streak; lower: the largest

    def extend(self, now: float, estimate: int, pick) -> None:
        if self.since is None or now - self.last > STALE_S:
            self.since, self.ticks, self.bound = now, 0, estimate
        self.last, self.ticks, self.bound = now, self.ticks + 1, pick(self.bound, estimate)

    def held(self, now: float, seconds: float) -> bool:
        return self.since is not None and self.ticks >= 2 and now - self.since >= seconds - 1e-6


@dataclass
class WorkerTrack:
    lanes: int  # live lanes the worker admits now
    overhead: float  # a step's fixed cost in lanes' worth
    up: Streak = field(default_factory=Streak)
    down: Streak = field(default_factory=Streak)
    cost_ms: float | None = None  # the last tick's p95 step cost per lane-equivalent
    samples: int = 0  # steps timed in the last tick that had any
    batch: int = 0  # the largest batch among them

    def projected_ms(self, lanes: int | None = None) -> float | None:
        """Projected step p95 (ms) at `lanes` (default: the capacity)."""
        lanes = self.lanes if lanes is None else lanes
        return None if self.cost_ms is None else self.cost_ms * (self.overhead + lanes)


class CapacityTracker:
    """A measured capacity, re-estimated from step timings while serving (event loop only).

    `update(now, samples, live)` takes, per worker, the (batch, seconds) of the steps timed since the
    last call and the live lanes its admitted streams hold; it returns the new `Capacity` when a worker's
    capacity changed, else None. The clock and the timings are the caller's: tests feed a step-time
    model and a fake clock."""

    def __init__(self, capacity: Capacity, max_streams: int, raise_after_s: float = 10.0,
                 lower_after_s: float = 3.0, headroom: float = RAISE_HEADROOM, min_samples: int = MIN_SAMPLES):
        self.capacity, self.max_streams = capacity, max_streams
        self.raise_after_s, self.lower_after_s = raise_after_s, lower_after_s
        self.headroom, self.min_samples = headroom, min_samples
        points = capacity.step_p50_ms or (capacity.step_p99_ms[0] if capacity.step_p99_ms else {})
        self.workers = [WorkerTrack(lanes, overhead_lanes(points)) for lanes in capacity.per_worker]
        self.changes = {"up": 0, "down": 0}
        self.reasons: list[str] = []  # why the last change was made, one line per worker changed

    def _fit(self, w: WorkerTrack, budget_ms: float) -> int:
        """Lanes whose projected p95 is within `budget_ms` (0..max_streams)."""
        lanes = math.floor(budget_ms / max(w.cost_ms, 1e-6) - w.overhead + 1e-9)
        return int(min(max(lanes, 0), self.max_streams))

    def update(self, now: float, samples: Sequence[Sequence[tuple[int, float]]],
               live: Sequence[int]) -> Capacity | None:
        budget = self.capacity.budget_ms
        self.reasons = []
        for i, (w, timed, held) in enumerate(zip(self.workers, samples, live)):
            if len(timed) < self.min_samples:
                continue
            t = np.asarray(timed, float)
            w.cost_ms = float(np.percentile(1000 * t[:, 1] / (w.overhead + t[:, 0]), TAIL_QUANTILE))
            w.samples, w.batch = len(t), int(t[:, 0].max())
            up, down = self._fit(w, budget * (1 - self.headroom)), self._fit(w, budget)
            if up > w.lanes:
                w.up.extend(now, up, min)
            else:
                w.up = Streak()
            if down < w.lanes:
                w.down.extend(now, down, max)
            else:
                w.down = Streak()
            new = w.lanes
            if w.up.held(now, self.raise_after_s):
                new, seconds, direction = w.up.bound, now - w.up.since, "up"
            elif w.down.held(now, self.lower_after_s):
                new, seconds, direction = max(w.down.bound, held), now - w.down.since, "down"
            if new == 0 and not any(x.lanes for x in self.workers if x is not w):
                new = 1  # as at start-up: one stream is admitted even when none fits
            if new == w.lanes:
                continue
            self.reasons.append(
                f"worker {i}: {w.lanes} -> {new} (step p95 {w.cost_ms:.2f} ms per lane-equivalent for {seconds:.0f} s, "
                f"batches up to {w.batch}, overhead {w.overhead:.1f} lanes: {new} lanes project to "
                f"{w.projected_ms(new):.1f} ms of the {budget:.1f} ms budget" + (f"; {held} held by admitted streams"
                                                                               if new == held and direction == "down"
                                                                               else "") + ")")
            self.changes[direction] += 1
            w.lanes, w.up, w.down = new, Streak(), Streak()
        if not self.reasons:
            return None
        per = [w.lanes for w in self.workers]
        self.capacity = dataclasses.replace(self.capacity, streams=min(sum(per), self.max_streams),
                                            per_worker=tuple(per))
        return self.capacity

    def public(self) -> dict:
        """What /readyz shows of the estimate."""
        return {"follows": True, "changes": dict(self.changes), "raise_after_s": self.raise_after_s,
                "lower_after_s": self.lower_after_s,
                "live": [{"overhead_lanes": round(w.overhead, 2),
                          "step_p95_ms_per_lane": None if w.cost_ms is None else round(w.cost_ms, 3),
                          "projected_p95_ms": None if w.cost_ms is None else round(w.projected_ms(), 2),
                          "samples": w.samples, "batch": w.batch} for w in self.workers]}
