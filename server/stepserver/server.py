"""One process that owns the accelerator and steps the streams of several service processes.

A GPU steps 1,000 streams about as fast as one (the step is bound by kernel launches, not by the
batch), but one service process cannot feed it: its event loop (websocket I/O, decoding, resampling)
and its worker share one interpreter, and a few dozen live streams fill them. Several processes
each with their own CUDA session do not add up either: the GPU runs one context at a time, so their
steps queue behind each other. So the model runs in one process, the step server, and the service
runs as several front-end processes (`enhancer serve --step-server ADDRESS`) whose workers step
their streams through it (`RemoteLanePool`, the interface of `LanePool`):

    enhancer step-server --address /run/tim/step.sock --device cuda --lanes 1024
    enhancer serve --port 8000 --step-server /run/tim/step.sock --capacity 48    # several of these

The step server holds every stream's state in one lane pool on the device (`make_pool`: a
`DeviceLanePool` under CUDA), hands out lanes on request (the lowest free ones, so the lanes in use
stay together and a step covers few idle ones), and serves the front-ends' calls in rounds: a round
takes every call that has arrived, waiting up to `--gather-ms` for the front-ends that stepped in
the last round, and runs all its live steps (one hop) as one batched step (over the whole pool with
`--full-steps`); multi-frame calls (files, backlogs) run one by one after it. A call
that fails in a batch is retried alone, so a fault tied to one front-end's streams fails that call
only. A front-end that disconnects has its lanes freed.

Transport: `multiprocessing.connection` over a Unix socket (pickled messages: one hop of audio per
lane each way). Whoever can open the socket can talk to the step server: put it in a folder only
the service's user may enter, and set `$TIM_ENHANCER_STEP_KEY` (a shared key, checked on connect). Requests and replies are tuples: ("hello",), ("alloc", n), ("free", lanes),
("reset", lanes), ("run", lanes, hops (k, T, hop), min_gain (k,)); replies ("ok", ...) or
("error", message).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from multiprocessing.connection import Client, Connection, Listener, wait
from pathlib import Path

import numpy as np

from enhancer.engine import Stepping, StepResult

log = logging.getLogger("tim_enhancer.stepserver")
KEY_ENV = "TIM_ENHANCER_STEP_KEY"  # shared secret of the step server and its front-ends (default: none)
POLL_S = 0.05  # the round loop wakes at least this often (new connections, stop)
# A round waits for the front-ends that stepped in the last one, at most this long after its first
# call: one batched step per hop for every front-end, not one per front-end (each would wait for the
# others' steps).
GATHER_MS = 4.0
REPORT_S = 10.0  # the log reports the rounds this often


def _authkey() -> bytes | None:
    key = os.environ.get(KEY_ENV)
    return key.encode() if key else None


class StepServer:
    """The step server: a lane pool of `lanes` lanes on `device`, served at `address` (a Unix
    socket path). `serve_forever` runs the rounds on the calling thread; `stop` ends it."""

    def __init__(self, address: str, model=None, device: str = "auto", lanes: int = 1024, threads: int = 1,
                 gather_ms: float = GATHER_MS, full_steps: bool | None = None):
        from enhancer.device_pool import make_pool
        from enhancer.devices import check_device, providers_for
        from enhancer.runtime import Enhancer

        check_device(device)
        self.enhancer = Enhancer.from_pretrained(model, providers=providers_for(device), threads=threads)
        check_device(device, self.enhancer.provider)
        self.pool = make_pool(self.enhancer.engine, lanes, full_steps=full_steps)
        self.gather_s = gather_ms / 1000.0
        self.address = str(address)
        if Path(self.address).exists():  # a socket left by a process that died
            Path(self.address).unlink()
        self.listener = Listener(self.address, family="AF_UNIX", authkey=_authkey())
        os.chmod(self.address, 0o600)  # this user's processes only (the front-ends run as the same user)
        self._new: list[Connection] = []
        self._lock = threading.Lock()
        self.owned: dict[Connection, set[int]] = {}
        self._stopping = False
        self.rounds = 0
        self.batched_lanes = 0
        self._window: list[tuple[int, float]] = []  # (calls, seconds) of the rounds since the last report
        threading.Thread(target=self._accept, name="step-server-accept", daemon=True).start()

    def hello(self) -> dict:
        eng = self.enhancer.engine
        return {"config": eng.config.to_dict(), "lanes": self.pool.capacity, "provider": eng.provider,
                "model": str(eng.path), "pool": type(self.pool).__name__, "pid": os.getpid(),
                "full_steps": getattr(self.pool, "full_step", None) is not None}

    def _accept(self) -> None:
        while not self._stopping:
            try:
                conn = self.listener.accept()
            except (OSError, EOFError):  # closed by stop(), or a client that failed authentication
                if self._stopping:
                    return
                continue
            with self._lock:
                self._new.append(conn)

    def stop(self) -> None:
        self._stopping = True
        try:
            self.listener.close()
        except OSError:
            pass

    def _drop(self, conn: Connection) -> None:
        lanes = self.owned.pop(conn, set())
        if lanes:
            self.pool.free(sorted(lanes))
            log.info("front-end disconnected: %d lane(s) freed", len(lanes))
        try:
            conn.close()
        except OSError:
            pass

    def serve_forever(self) -> None:
        log.info("step server at %s: %s, %d lanes (%s%s)", self.address, self.enhancer.provider, self.pool.capacity,
                 type(self.pool).__name__, ", full-pool live steps" if getattr(self.pool, "full_step", None) else "")
        next_report = time.monotonic() + REPORT_S
        pending: list[tuple[Connection, tuple]] = []  # calls to step in the next round
        first = 0.0  # when the first of them arrived
        expected: set[Connection] = set()  # the front-ends that stepped in the last round
        while not self._stopping:
            with self._lock:
                for c in self._new:
                    self.owned[c] = set()
                self._new.clear()
            conns = list(self.owned)
            timeout = POLL_S if not pending else max(0.0, first + self.gather_s - time.perf_counter())
            ready = wait(conns, timeout=timeout) if conns else (time.sleep(POLL_S) or [])
            bookkeeping = []
            for conn in ready:
                try:
                    while conn.poll():
                        msg = conn.recv()
                        if msg and msg[0] == "run":
                            if not pending:
                                first = time.perf_counter()
                            pending.append((conn, msg))
                        else:
                            bookkeeping.append((conn, msg))
                except (EOFError, OSError):
                    self._drop(conn)
            if bookkeeping:  # lanes and resets at once: a stream being opened waits for no round
                self.round(bookkeeping)
            if pending:
                submitted = {c for c, _ in pending}
                if (expected & set(self.owned)) <= submitted or time.perf_counter() >= first + self.gather_s:
                    t0 = time.perf_counter()
                    self.round(pending)
                    self._window.append((len(pending), time.perf_counter() - t0))
                    expected, pending = submitted, []
            if time.monotonic() >= next_report:
                self._report()
                next_report = time.monotonic() + REPORT_S
        for conn in list(self.owned):  # stopped: the front-ends see the connection end
            self._drop(conn)

    def _report(self) -> None:
        """Every REPORT_S: rounds, calls per round and round time since the last report (the log)."""
        window, self._window = self._window, []
        if not window:
            return
        ms = sorted(1000 * t for _, t in window)
        log.info("%d rounds in %g s: %.1f calls per round, round p50 %.1f ms, max %.1f ms; %d front-end(s), "
                 "%d of %d lanes in use", len(window), REPORT_S, sum(n for n, _ in window) / len(window),
                 ms[len(ms) // 2], ms[-1], len(self.owned), self.pool.capacity - self.pool.n_free, self.pool.capacity)

    def round(self, requests: list[tuple[Connection, tuple]]) -> None:
        """Answer one round of requests: lane bookkeeping first, then every live step in one batched
        call, then the multi-frame calls one by one."""
        live, multi = [], []
        for conn, msg in requests:
            if conn not in self.owned:
                continue
            try:
                kind = msg[0]
                if kind == "run":
                    lanes = np.asarray(msg[1], dtype=np.int64)
                    foreign = set(lanes.tolist()) - self.owned[conn]
                    if foreign:
                        raise ValueError(f"lanes {sorted(foreign)[:8]} are not this front-end's")
                    (live if msg[2].shape[1] == 1 else multi).append((conn, lanes, msg[2], msg[3]))
                else:
                    self._reply(conn, ("ok", *self._bookkeeping(conn, msg)))
            except Exception as e:  # a bad request fails alone
                self._reply(conn, ("error", f"{type(e).__name__}: {e}"))
        if live:
            self._run_batched(live)
        for call in multi:
            self._run_batched([call])

    def _bookkeeping(self, conn: Connection, msg: tuple) -> tuple:
        kind = msg[0]
        if kind == "hello":
            return (self.hello(),)
        if kind == "alloc":
            lanes = self.pool.alloc(int(msg[1]))
            self.owned[conn].update(int(x) for x in lanes)
            return (lanes,)
        lanes = [int(x) for x in msg[1]]
        foreign = set(lanes) - self.owned[conn]
        if foreign:
            raise ValueError(f"lanes {sorted(foreign)[:8]} are not this front-end's")
        if kind == "free":
            self.owned[conn].difference_update(lanes)
            self.pool.free(lanes)
            return ()
        if kind == "reset":
            self.pool.reset(np.asarray(lanes, dtype=np.int64))
            return ()
        raise ValueError(f"unknown request {kind!r}")

    def _run_batched(self, calls: list) -> None:
        lanes = np.concatenate([c[1] for c in calls])
        try:
            r = self.pool.run(lanes, np.concatenate([c[2] for c in calls]), np.concatenate([c[3] for c in calls]))
        except Exception as e:
            if len(calls) == 1:
                self._reply(calls[0][0], ("error", f"{type(e).__name__}: {e}"))
                return
            log.warning("a batched step of %d calls failed (%s): each alone", len(calls), type(e).__name__)
            for call in calls:
                self._run_batched([call])
            return
        self.rounds += 1
        self.batched_lanes += len(lanes)
        o = 0
        for conn, ln, _, _ in calls:
            k = len(ln)
            comp = None if r.competition is None else r.competition[o:o + k]
            self._reply(conn, ("ok", r.out[o:o + k], comp, r.activity[o:o + k]))
            o += k

    def _reply(self, conn: Connection, msg: tuple) -> None:
        try:
            conn.send(msg)
        except (OSError, EOFError, BrokenPipeError):
            self._drop(conn)


class StepServerError(RuntimeError):
    """The step server refused a call or went away."""


class RemoteLanePool(Stepping):
    """`LanePool`'s interface over a step server: `capacity` lanes of this front-end (the step
    server hands out the lanes themselves); `engine` is the front-end's local copy of the model
    (its config; it never steps). One caller at a time (a worker's thread), but `connected` may be
    asked from any thread.

    When the connection breaks (the step server restarted, say), the call fails, and so does every
    later call on the lanes held then: their state went with the connection, and their streams end
    with an error. The next call reconnects (at most once a second); `connected` tries too, so that
    an idle front-end's readiness (`/readyz`) follows the step server. `free` never fails."""

    RECONNECT_S = 1.0
    ANSWER_S = 5.0  # a call unanswered this long: the step server is taken for hung, the connection dropped

    def __init__(self, address: str, capacity: int, engine):
        self.address, self.capacity, self.engine = str(address), int(capacity), engine
        self._lock = threading.Lock()
        self.conn: Connection | None = None
        self._lanes: set[int] = set()  # lanes held on the present connection
        self._next_try = 0.0
        self.info: dict = {}
        with self._lock:
            self._connect()

    def _connect(self) -> None:
        """(Re)connect and check the model (the lock held); StepServerError if it fails."""
        self._next_try = time.monotonic() + self.RECONNECT_S
        try:
            conn = Client(self.address, family="AF_UNIX", authkey=_authkey())
            conn.send(("hello",))
            if not conn.poll(self.ANSWER_S):
                conn.close()
                raise StepServerError(f"the step server at {self.address} did not answer in {self.ANSWER_S:g} s")
            reply = conn.recv()
        except (OSError, EOFError) as e:
            raise StepServerError(f"cannot reach the step server at {self.address}: {e}") from None
        if reply[0] != "ok":
            conn.close()
            raise StepServerError(f"step server: {reply[1]}")
        if reply[1]["config"] != self.engine.config.to_dict():
            conn.close()
            raise StepServerError(f"the step server at {self.address} runs another model ({reply[1]['model']}) "
                                  f"than this front-end ({self.engine.path}): serve the same file")
        self.conn, self.info, self._lanes = conn, reply[1], set()

    def _broken(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except OSError:
                pass
        self.conn, self._lanes = None, set()

    @property
    def connected(self) -> bool:
        """Whether the step server answers (reconnecting if the connection broke, at most once a
        second). Never waits: with a call in flight, the connection is as good as that call."""
        if not self._lock.acquire(blocking=False):  # e.g. /readyz on the event loop while the worker steps
            return self.conn is not None
        try:
            try:  # between calls nothing is due: something readable is the step server closing
                if self.conn is not None and self.conn.poll(0):
                    self._broken()
            except (OSError, EOFError):
                self._broken()
            if self.conn is None and time.monotonic() >= self._next_try:
                try:
                    self._connect()
                except StepServerError:
                    pass
            return self.conn is not None
        finally:
            self._lock.release()

    def _call(self, *msg) -> tuple:
        with self._lock:
            if self.conn is None:
                if time.monotonic() < self._next_try:
                    raise StepServerError(f"the step server at {self.address} is not connected")
                self._connect()
            try:
                self.conn.send(msg)
                if not self.conn.poll(self.ANSWER_S):
                    self._broken()
                    raise StepServerError(f"the step server at {self.address} did not answer in {self.ANSWER_S:g} s")
                reply = self.conn.recv()
            except (OSError, EOFError) as e:
                self._broken()
                raise StepServerError(f"the step server at {self.address} went away ({type(e).__name__})") from None
        if reply[0] != "ok":
            raise StepServerError(f"step server: {reply[1]}")
        return reply[1:]

    def _held(self, lanes) -> list[int]:
        lanes = [int(x) for x in lanes]
        foreign = set(lanes) - self._lanes
        if foreign:
            raise StepServerError(f"lanes {sorted(foreign)[:8]} are not this front-end's (a stream's lanes go with "
                                  "a broken connection to the step server; it must start again)")
        return lanes

    @property
    def owned(self) -> int:
        return len(self._lanes)

    @property
    def n_free(self) -> int:
        return self.capacity - self.owned

    def alloc(self, n: int) -> np.ndarray:
        if n > self.n_free:
            raise RuntimeError(f"no free lanes: {n} requested, {self.n_free} free of {self.capacity}")
        lanes = self._call("alloc", int(n))[0]
        self._lanes.update(int(x) for x in lanes)
        return lanes

    def free(self, lanes) -> None:
        held = [int(x) for x in lanes if int(x) in self._lanes]
        if not held:
            return  # lanes of a broken connection: the step server freed them when it ended
        self._lanes.difference_update(held)
        try:
            self._call("free", held)
        except StepServerError as e:  # the connection broke: the step server frees them itself
            log.warning("freeing %d lane(s) on the step server failed: %s", len(held), e)

    def reset(self, lanes) -> None:
        self._call("reset", self._held(lanes))

    def run(self, lanes: np.ndarray, hops: np.ndarray, min_gain: np.ndarray) -> StepResult:
        self._held(lanes)
        out, comp, activity = self._call("run", np.asarray(lanes, dtype=np.int64),
                                         np.ascontiguousarray(hops, dtype=np.float32),
                                         np.ascontiguousarray(min_gain, dtype=np.float32))
        return StepResult(out=out, competition=comp, activity=activity)

    def close(self) -> None:
        with self._lock:
            self._broken()


def main(argv=None) -> int:
    """`enhancer step-server` / `python -m server.stepserver`."""
    import argparse

    from enhancer.devices import DEVICES

    p = argparse.ArgumentParser(prog="enhancer step-server", description=__doc__.split("\n")[0])
    add_arguments(p, DEVICES)
    return run(p.parse_args(argv))


def add_arguments(p, devices) -> None:
    p.add_argument("--address", required=True, help="Unix socket path the front-ends connect to (--step-server)")
    p.add_argument("--model", default=None, help="exported .onnx model (default: the shipped one); the front-ends "
                   "must load the same file")
    p.add_argument("--device", choices=devices, default="auto", help="where to run the model (auto: CUDA when "
                   "this onnxruntime has it, else CPU)")
    p.add_argument("--lanes", type=int, default=1024, help="lanes of the pool (one per channel of every stream "
                   "and file of every front-end)")
    p.add_argument("--full-steps", action="store_true", default=None, help="each round's live step covers the "
                   "whole pool through a static graph, replayed as a CUDA graph under CUDA (one launch instead of "
                   "a thousand; default: $TIM_ENHANCER_FULL_STEPS=1)")
    p.add_argument("--gather-ms", type=float, default=GATHER_MS, help="how long a round waits for the front-ends "
                   "that stepped in the last one (one batched step per hop for all of them)")


def run(a) -> int:
    """Serve until SIGTERM / SIGINT."""
    import signal

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    srv = StepServer(a.address, a.model, a.device, a.lanes, gather_ms=a.gather_ms, full_steps=a.full_steps)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: srv.stop())
    srv.serve_forever()
    return 0

