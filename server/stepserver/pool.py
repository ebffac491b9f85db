"""`RemoteLanePool`: the lane pool a front-end (`enhancer serve --step-server`) steps through the
step server, with `LanePool`'s interface (alloc, free, reset, run, step, export_lanes, import_lanes,
n_free, capacity)."""
from __future__ import annotations

import json
import logging
import select
import socket
import threading
import time

import numpy as np

from enhancer.engine import Stepping, StepResult
from enhancer.step_io import check_lane_arrays, lane_state_bytes

from . import auth, wire

log = logging.getLogger("tim_enhancer.stepserver")
STATE_BYTES = 32 << 20  # an export or import moves at most this much lane state per message (one lane at least)


class StepServerError(RuntimeError):
    """The step server refused a call or the key, or went away."""


class RemoteLanePool(Stepping):
    """`LanePool`'s interface over a step server: `capacity` lanes of this front-end (the step
    server hands out the lanes themselves); `engine` is the front-end's local copy of the model
    (its config; it never steps); `key` the key shared with the step server. One caller at a time
    (a worker's thread), but `connected` may be asked from any thread.

    When the connection breaks (the step server restarted, say), the call fails, and so does every
    later call on the lanes held then: their state went with the connection, and their streams end
    with an error. The next call reconnects (at most once a second); `connected` tries too, so that
    an idle front-end's readiness (`/readyz`) follows the step server. `free` never fails."""

    RECONNECT_S = 1.0
    ANSWER_S = 5.0  # a call unanswered this long: the step server is taken for hung, the connection dropped

    def __init__(self, address: str, capacity: int, engine, key: str | bytes | None = None):
        self.address, self.capacity, self.engine = str(address), int(capacity), engine
        if not key:
            raise StepServerError("no key for the step server: set $TIM_ENHANCER_STEP_KEY or --step-key-file "
                                  "(the step server's key)")
        self._key = auth.as_key(key)
        self._lock = threading.Lock()
        self.conn: socket.socket | None = None
        self._lanes: set[int] = set()  # lanes held on the present connection
        self._next_try = 0.0
        self._rid = 0
        self.info: dict = {}
        with self._lock:
            self._connect()

    def _connect(self) -> None:
        """(Re)connect, prove the key and check the model (the lock held); StepServerError if it fails."""
        self._next_try = time.monotonic() + self.RECONNECT_S
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.ANSWER_S)
            sock.connect(self.address)
        except OSError as e:
            sock.close()
            raise StepServerError(f"cannot reach the step server at {self.address}: {e}") from None
        try:
            auth.answer(sock, self._key, self.ANSWER_S)
        except auth.KeyRefused as e:
            sock.close()
            what = "refused the key" if str(e) == auth.REFUSED else f"failed the key check ({e})"
            raise StepServerError(f"the step server at {self.address} {what}: the step server and its front-ends "
                                  "need the same key ($TIM_ENHANCER_STEP_KEY or a key file)") from None
        except BaseException as e:
            sock.close()
            raise self._failure(e) from None
        self.conn, self._lanes = sock, set()
        try:
            info = self._exchange(wire.request("hello", self._next_id())).meta
        except StepServerError:
            self._broken()
            raise
        local = json.loads(json.dumps(self.engine.config.to_dict()))  # as it comes over the wire
        if info.get("config") != local:
            self._broken()
            raise StepServerError(f"the step server at {self.address} runs another model ({info.get('model')}) "
                                  f"than this front-end ({self.engine.path}): serve the same file")
        self.info = info

    def _failure(self, e: BaseException) -> BaseException:
        """The StepServerError of a failed exchange (anything else as it is)."""
        if isinstance(e, TimeoutError):
            return StepServerError(f"the step server at {self.address} did not answer in {self.ANSWER_S:g} s")
        if isinstance(e, wire.ProtocolError):
            return StepServerError(f"the step server at {self.address} sent a malformed message: {e}")
        if isinstance(e, (OSError, EOFError)):
            return StepServerError(f"the step server at {self.address} went away ({type(e).__name__})")
        return e

    def _next_id(self) -> int:
        self._rid = (self._rid + 1) % (1 << 32)
        return self._rid

    def _exchange(self, msg: wire.Message) -> wire.Message:
        """Send a request, return its reply (the lock held, connected); StepServerError if it fails."""
        try:
            wire.send(self.conn, msg, self.ANSWER_S)
            reply = wire.recv(self.conn, self.ANSWER_S)
            if reply.request != msg.request:
                raise wire.ProtocolError(f"the reply to request {reply.request}, not {msg.request}")
        except BaseException as e:
            self._broken()
            raise self._failure(e) from None
        if reply.kind == wire.ERROR:
            raise StepServerError(f"step server: {reply.meta.get('error')}")
        return reply

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
                if self.conn is not None and select.select([self.conn], [], [], 0)[0]:
                    self._broken()
            except (OSError, ValueError):
                self._broken()
            if self.conn is None and time.monotonic() >= self._next_try:
                try:
                    self._connect()
                except StepServerError:
                    pass
            return self.conn is not None
        finally:
            self._lock.release()

    def _call(self, kind: str, *args) -> wire.Message:
        """One request ("hello", "alloc", "free", "reset", "run", "export", "import") and its reply."""
        with self._lock:
            if self.conn is None:
                if time.monotonic() < self._next_try:
                    raise StepServerError(f"the step server at {self.address} is not connected")
                self._connect()
            return self._exchange(wire.request(kind, self._next_id(), *args))

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
        reply = self._call("alloc", int(n))
        if len(reply.arrays) != 1 or reply.arrays[0].dtype != np.int64 or reply.arrays[0].shape != (n,):
            raise StepServerError(f"the step server answered an alloc of {n} with {reply.arrays}")
        lanes = reply.arrays[0]
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
        reply = self._call("run", np.asarray(lanes, dtype=np.int64), np.ascontiguousarray(hops, dtype=np.float32),
                           np.ascontiguousarray(min_gain, dtype=np.float32))
        try:
            return wire.to_result(reply)
        except wire.ProtocolError as e:
            raise StepServerError(f"the step server at {self.address} sent a malformed result: {e}") from None

    def export_lanes(self, lanes: np.ndarray) -> dict[str, np.ndarray]:
        """The state of `lanes` (this front-end's) from the step server, in messages of at most
        STATE_BYTES of state each, checked against the model's arrays."""
        lanes = np.asarray(self._held(lanes), dtype=np.int64)
        parts = []
        for part in self._parts(len(lanes)):
            reply = self._call("export", lanes[part])
            try:
                parts.append(check_lane_arrays(self.engine, len(lanes[part]), wire.to_lane_state(reply)))
            except ValueError as e:  # a ProtocolError too
                raise StepServerError(f"the step server at {self.address} sent a malformed lane state: {e}") from None
        if len(parts) == 1:
            return parts[0]
        return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}

    def import_lanes(self, lanes: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        """Set the state of `lanes` (this front-end's, each once) on the step server, in messages of
        at most STATE_BYTES of state each; ValueError, and nothing sent, when an array's name,
        shape or dtype is not the model's. (A connection that breaks half-way leaves the lanes
        gone with it.)"""
        lanes = np.asarray(self._held(lanes), dtype=np.int64)
        if len(set(lanes.tolist())) != len(lanes):
            raise ValueError("lanes repeat")
        arrays = check_lane_arrays(self.engine, len(lanes), arrays)
        for part in self._parts(len(lanes)):
            self._call("import", lanes[part], {name: a[part] for name, a in arrays.items()})

    def _parts(self, k: int) -> list[slice]:
        """k lanes in parts of at most STATE_BYTES of state (one part when k is 0)."""
        per = max(1, STATE_BYTES // lane_state_bytes(self.engine, 1))
        return [slice(i, min(i + per, k)) for i in range(0, k, per)] or [slice(0, 0)]

    def close(self) -> None:
        with self._lock:
            self._broken()
