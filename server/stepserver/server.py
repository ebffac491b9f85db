"""One process that owns the accelerator and steps the streams of several service processes.

The model runs in one process, the step server, and the service runs as several front-end
processes (`enhancer serve --step-server ADDRESS`) whose workers step their streams through it
(`RemoteLanePool`, the interface of `LanePool`):

    enhancer step-server --address /run/tim/step.sock --key-file /run/tim/step.key --device cuda --lanes 1024
    enhancer serve --port 8000 --step-server /run/tim/step.sock --step-key-file /run/tim/step.key --capacity 48

The step server holds every stream's state in one lane pool on the device (`make_pool`: a
`DeviceLanePool` under CUDA), hands out lanes on request (the lowest free ones, so the lanes in use
stay together and a step covers few idle ones), and serves the front-ends' calls in rounds: a round
takes every call that has arrived, waiting up to `--gather-ms` for the front-ends that stepped in
the last round, and runs all its live steps (one hop) as one batched call (over the whole pool
with `--full-steps`); multi-frame calls (files, backlogs) run one by one after it. Both go through
`server.scheduling.calls.run_parts`: a batched call that fails is retried part by part, so a fault
tied to one front-end's streams fails that call only. A front-end that disconnects, or sends a
malformed message, is dropped and its lanes freed. A front-end may also read out the state of
its lanes and set it in others of its own (`export_lanes`, `import_lanes`: a stream handed from one
process to another); a state that is not the model's is refused with an error, the front-end kept.

Transport: a Unix stream socket (mode 0600) and the framed binary messages of `wire` (raw arrays,
no pickle). The step server does not start without a shared key; a connection must complete the
HMAC challenge-response of `auth` (both sides prove the key, which is never sent) within
`fronts.HANDSHAKE_S`, else it is dropped (`fronts`: the connections).
"""
from __future__ import annotations

import argparse
import logging
import os
import time

import numpy as np

from enhancer.errors import EnhancerError
from enhancer.step_io import check_lane_arrays, lane_state_bytes
from server.scheduling.calls import Part, run_parts

from . import auth, wire
from .fronts import Front, Fronts

log = logging.getLogger("tim_enhancer.stepserver")
POLL_S = 0.05  # the round loop wakes at least this often
# A round waits for the front-ends that stepped in the last one, at most this long after its first
# call: one batched step per hop for every front-end, not one per front-end (each would wait for the
# others' steps).
GATHER_MS = 4.0
REPORT_S = 10.0  # the log reports the rounds this often
NO_KEY = ("the step server needs a shared key: --key-file PATH or $TIM_ENHANCER_STEP_KEY (its front-ends take "
          "the same key: enhancer serve --step-key-file PATH or $TIM_ENHANCER_STEP_KEY)")


class StepServer:
    """The step server: a lane pool of `lanes` lanes on `device`, served at `address` (a Unix
    socket path) to the front-ends that hold `key`. `serve_forever` runs the rounds on the calling
    thread; `stop` ends it."""

    def __init__(self, address: str, model=None, device: str = "auto", lanes: int = 1024, threads: int = 1,
                 gather_ms: float = GATHER_MS, full_steps: bool = False, key: str | bytes | None = None,
                 device_pool: bool = False):
        if not key:
            raise EnhancerError(NO_KEY)
        from enhancer.device_pool import make_pool
        from enhancer.devices import check_device, providers_for
        from enhancer.runtime import Enhancer

        check_device(device)
        self.enhancer = Enhancer.from_pretrained(model, providers=providers_for(device), threads=threads)
        check_device(device, self.enhancer.provider)
        self.pool = make_pool(self.enhancer.engine, lanes, full_steps=bool(full_steps), device_pool=device_pool)
        self.gather_s = gather_ms / 1000.0
        self.address = str(address)
        self.fronts = Fronts(self.address, auth.as_key(key), on_drop=self._free)
        self._stopping = False
        self.rounds = 0
        self.batched_lanes = 0
        self._window: list[tuple[int, float]] = []  # (calls, seconds) of the rounds since the last report

    def hello(self) -> dict:
        eng = self.enhancer.engine
        return {"config": eng.config.to_dict(), "lanes": self.pool.capacity, "provider": eng.provider,
                "model": str(eng.path), "pool": type(self.pool).__name__, "pid": os.getpid(),
                "full_steps": self.pool.full_step is not None}

    def stop(self) -> None:
        """End `serve_forever` (its front-ends see their connections close); new connections are refused now."""
        self._stopping = True
        self.fronts.stop()

    def _free(self, front: Front) -> None:
        """A front-end dropped: its lanes go back to the pool."""
        if front.lanes:
            self.pool.free(sorted(front.lanes))
            log.info("front-end disconnected: %d lane(s) freed", len(front.lanes))
            front.lanes = set()

    # rounds
    def serve_forever(self) -> None:
        log.info("step server at %s: %s, %d lanes (%s%s)", self.address, self.enhancer.provider, self.pool.capacity,
                 type(self.pool).__name__, ", full-pool live steps" if self.pool.full_step is not None else "")
        next_report = time.monotonic() + REPORT_S
        pending: list[tuple[Front, wire.Message]] = []  # calls to step in the next round
        first = 0.0  # when the first of them arrived
        expected: set[Front] = set()  # the front-ends that stepped in the last round
        try:
            while not self._stopping:
                timeout = POLL_S if not pending else max(0.0, first + self.gather_s - time.perf_counter())
                bookkeeping = []
                for front, msg in self.fronts.read(timeout):
                    if msg.kind != wire.RUN:
                        bookkeeping.append((front, msg))
                        continue
                    if not pending:
                        first = time.perf_counter()
                    pending.append((front, msg))
                if bookkeeping:  # lanes and resets at once: a stream being opened waits for no round
                    self.round(bookkeeping)
                if pending:
                    submitted = {f for f, _ in pending}
                    if (expected & self.fronts.live) <= submitted or time.perf_counter() >= first + self.gather_s:
                        t0 = time.perf_counter()
                        self.round(pending)
                        self._window.append((len(pending), time.perf_counter() - t0))
                        expected, pending = submitted, []
                if time.monotonic() >= next_report:
                    self._report()
                    next_report = time.monotonic() + REPORT_S
        finally:
            self.fronts.close()

    def _report(self) -> None:
        """Every REPORT_S: rounds, calls per round and round time since the last report (the log)."""
        window, self._window = self._window, []
        if not window:
            return
        ms = sorted(1000 * t for _, t in window)
        log.info("%d rounds in %g s: %.1f calls per round, round p50 %.1f ms, max %.1f ms; %d front-end(s), "
                 "%d of %d lanes in use", len(window), REPORT_S, sum(n for n, _ in window) / len(window),
                 ms[len(ms) // 2], ms[-1], len(self.fronts), self.pool.capacity - self.pool.n_free, self.pool.capacity)

    def round(self, requests: list[tuple[Front, wire.Message]]) -> None:
        """Answer one round of requests: lane bookkeeping first, then every live step in one batched
        call, then the multi-frame calls one by one."""
        live, multi = [], []
        for front, msg in requests:
            if front not in self.fronts:
                continue
            try:
                if msg.kind == wire.RUN:
                    lanes, hops, gains = msg.arrays
                    self._owned(front, lanes)
                    (live if hops.shape[1] == 1 else multi).append(Part((front, msg.request), lanes, hops, gains))
                else:
                    self.fronts.reply(front, self._bookkeeping(front, msg))
            except Exception as e:  # a bad request fails alone
                self.fronts.reply(front, wire.error(msg.request, f"{type(e).__name__}: {e}"))
        run_parts(self._run, live, self._done, self._failed)
        for part in multi:
            run_parts(self._run, [part], self._done, self._failed)

    @staticmethod
    def _owned(front: Front, lanes) -> list[int]:
        lanes = [int(x) for x in lanes]
        foreign = set(lanes) - front.lanes
        if foreign:
            raise ValueError(f"lanes {sorted(foreign)[:8]} are not this front-end's")
        return lanes

    def _bookkeeping(self, front: Front, msg: wire.Message) -> wire.Message:
        if msg.kind == wire.HELLO:
            return wire.ok(msg.request, self.hello())
        if msg.kind == wire.ALLOC:
            lanes = np.asarray(self.pool.alloc(msg.meta["n"]), dtype=np.int64)
            front.lanes.update(int(x) for x in lanes)
            return wire.ok(msg.request, arrays=(lanes,))
        lanes = self._owned(front, msg.arrays[0])
        if msg.kind == wire.FREE:
            front.lanes.difference_update(lanes)
            self.pool.free(lanes)
        elif msg.kind == wire.RESET:
            self.pool.reset(np.asarray(lanes, dtype=np.int64))
        elif msg.kind == wire.EXPORT:
            return wire.lane_state(msg.request, self._export(lanes))
        else:  # wire.check_request let only these through
            self._import(lanes, msg)
        return wire.ok(msg.request)

    def _export(self, lanes: list[int]) -> dict:
        """The state of `lanes` (a front-end's), if one reply can carry it (ValueError else)."""
        size = lane_state_bytes(self.pool.engine, len(lanes))
        if size > wire.MAX_STATE:
            raise ValueError(f"the state of {len(lanes)} lanes takes {size} bytes, one message holds "
                             f"{wire.MAX_STATE}: export fewer lanes at a time")
        return self.pool.export_lanes(np.asarray(lanes, dtype=np.int64))

    def _import(self, lanes: list[int], msg: wire.Message) -> None:
        """Set the state of `lanes` (a front-end's, each once) from an IMPORT's packed state, checked
        against the model's arrays first (ValueError, and nothing changed, if it is not)."""
        if len(set(lanes)) != len(lanes):
            raise ValueError("import: lanes repeat")
        arrays = check_lane_arrays(self.pool.engine, len(lanes), wire.to_lane_state(msg))
        self.pool.import_lanes(np.asarray(lanes, dtype=np.int64), arrays)

    def _run(self, lanes: np.ndarray, hops: np.ndarray, gains: np.ndarray):
        r = self.pool.run(lanes, hops, gains)
        self.rounds += 1
        self.batched_lanes += len(lanes)
        return r

    def _done(self, part: Part, r) -> None:
        front, rid = part.owner
        self.fronts.reply(front, wire.result(rid, r))

    def _failed(self, part: Part, e: Exception) -> None:
        front, rid = part.owner
        self.fronts.reply(front, wire.error(rid, f"{type(e).__name__}: {e}"))


def main(argv=None) -> int:
    """`python -m server.stepserver ARGS`: the same as `enhancer step-server ARGS`."""
    import sys

    from enhancer.cli import main as enhancer_main

    return enhancer_main(["step-server", *(sys.argv[1:] if argv is None else argv)])


def add_arguments(p, devices) -> None:
    p.add_argument("--address", required=True, help="Unix socket path the front-ends connect to (--step-server)")
    p.add_argument("--key-file", default=None, metavar="PATH", help="file holding the key shared with the "
                   "front-ends (its trailing newline stripped; default: $TIM_ENHANCER_STEP_KEY); required")
    p.add_argument("--model", default=None, help="exported .onnx model (default: the shipped one); the front-ends "
                   "must load the same file")
    p.add_argument("--device", choices=devices, default="auto", help="where to run the model (auto: CUDA when "
                   "this onnxruntime has it, else CPU)")
    p.add_argument("--lanes", type=int, default=1024, help="lanes of the pool (one per channel of every stream "
                   "and file of every front-end)")
    p.add_argument("--device-pool", action=argparse.BooleanOptionalAction, default=None, help="keep the "
                   "streams' state in a device pool on the CPU too (always under CUDA; default: "
                   "$TIM_ENHANCER_DEVICE_POOL=1)")
    p.add_argument("--full-steps", action=argparse.BooleanOptionalAction, default=None, help="each round's live step covers the "
                   "whole pool through a static graph, replayed as a CUDA graph under CUDA (one launch instead of "
                   "a thousand; default: $TIM_ENHANCER_FULL_STEPS=1)")
    p.add_argument("--gather-ms", type=float, default=GATHER_MS, help="how long a round waits for the front-ends "
                   "that stepped in the last one (one batched step per hop for all of them)")


def run(a, key: str | bytes | None = None) -> int:
    """Serve the parsed arguments `a` until SIGTERM / SIGINT; `key`: the shared key (`enhancer
    step-server` reads it from --key-file or $TIM_ENHANCER_STEP_KEY). No key: EnhancerError."""
    import signal

    if not key:
        raise EnhancerError(NO_KEY)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    srv = StepServer(a.address, a.model, a.device, a.lanes, gather_ms=a.gather_ms, full_steps=bool(a.full_steps), key=key,
                     device_pool=bool(a.device_pool))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: srv.stop())
    srv.serve_forever()
    return 0
