"""The step server (one process runs the model for several service processes) and `RemoteLanePool`:
remote steps equal local ones, lanes stay each front-end's own, a disconnect frees them, and two
services stepping through one step server each stream correctly (on the CPU provider)."""
from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest

from enhancer.engine import LanePool
from server.stepserver import RemoteLanePool, StepServer, StepServerError
from tests.conftest import speechlike
from tests.server.conftest import TEST_LIMITS, LiveServer
from tests.server.test_ws import stream_through
from tests.tolerance import assert_close_to_peak


@pytest.fixture
def step_server(model_path, tmp_path):
    srv = StepServer(str(tmp_path / "step.sock"), model_path, device="cpu", lanes=12)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.stop()
    t.join(timeout=5)


def test_two_front_ends_step_as_a_local_pool_would(step_server, enhancer_rt, rng):
    """Two clients step their streams at once (the step server batches them in rounds); each
    stream's output equals the same inputs through a local LanePool."""
    hop = enhancer_rt.config.stft.hop
    clients = [RemoteLanePool(step_server.address, 4, enhancer_rt.engine) for _ in range(2)]
    lanes = [c.alloc(3) for c in clients]
    assert not set(lanes[0].tolist()) & set(lanes[1].tolist())
    n_steps = 40
    x = (rng.standard_normal((2, n_steps, 3, hop)) * 0.1).astype(np.float32)
    outs = [[], []]

    def drive(i):
        for k in range(n_steps):
            frames = 1 if k % 10 else 3  # now and then a multi-frame call (a backlog), in the same rounds
            if frames == 1:
                outs[i].append(clients[i].step(lanes[i], x[i, k], np.zeros(3, np.float32)).out[:, None])
            else:
                outs[i].append(clients[i].run(lanes[i], np.repeat(x[i, k][:, None], 3, axis=1) * 0.5,
                                              np.zeros(3, np.float32)).out)

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # the two front-ends' calls share rounds (a round waits for the front-ends of the last one)
    assert 0 < step_server.rounds < 0.75 * 2 * n_steps
    for i in range(2):
        local = LanePool(enhancer_rt.engine, 3)
        ll = local.alloc(3)
        want = []
        for k in range(n_steps):
            if k % 10:
                want.append(local.step(ll, x[i, k], np.zeros(3, np.float32)).out[:, None])
            else:
                want.append(local.run(ll, np.repeat(x[i, k][:, None], 3, axis=1) * 0.5, np.zeros(3, np.float32)).out)
        got, ref = np.concatenate(outs[i], axis=1), np.concatenate(want, axis=1)
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


def test_the_socket_is_this_users_only(step_server):
    import os
    import stat

    assert stat.S_IMODE(os.stat(step_server.address).st_mode) == 0o600


def test_lanes_are_each_front_ends_own(step_server, enhancer_rt):
    a, b = (RemoteLanePool(step_server.address, 4, enhancer_rt.engine) for _ in range(2))
    la, lb = a.alloc(2), b.alloc(1)
    hop = enhancer_rt.config.stft.hop
    with pytest.raises(StepServerError, match="not this front-end's"):
        b.step(la, np.zeros((2, hop), np.float32), np.zeros(2, np.float32))
    free_before = step_server.pool.n_free
    b.free(la)  # not b's: ignored, a's lanes stay allocated
    assert step_server.pool.n_free == free_before and a.owned == 2
    with pytest.raises(StepServerError, match="not this front-end's"):  # the step server checks too
        b._call("free", [int(x) for x in la])
    with pytest.raises(RuntimeError, match="no free lanes"):
        b.alloc(4)  # its own capacity: 4, one in use
    assert b.step(lb, np.zeros((1, hop), np.float32), np.zeros(1, np.float32)).out.shape == (1, hop)


def test_a_disconnected_front_end_gives_its_lanes_back(step_server, enhancer_rt):
    c = RemoteLanePool(step_server.address, 6, enhancer_rt.engine)
    c.alloc(5)
    assert step_server.pool.n_free == 7
    c.close()
    deadline = time.time() + 5
    while step_server.pool.n_free != 12 and time.time() < deadline:
        time.sleep(0.02)
    assert step_server.pool.n_free == 12


def test_a_front_end_with_another_model_is_refused(step_server, enhancer_rt):
    from types import SimpleNamespace

    other = enhancer_rt.config.to_dict() | {"n_layers": 1}
    engine = SimpleNamespace(config=SimpleNamespace(to_dict=lambda: other), path="other.onnx")
    with pytest.raises(StepServerError, match="another model"):
        RemoteLanePool(step_server.address, 2, engine)


def test_no_step_server_is_a_clear_error(tmp_path, enhancer_rt):
    with pytest.raises(StepServerError, match="cannot reach the step server"):
        RemoteLanePool(str(tmp_path / "nobody.sock"), 2, enhancer_rt.engine)


def test_two_services_stream_through_one_step_server(step_server, model_path, enhancer_rt):
    """Two services (front-ends) on one step server: a stream through each gets its offline output."""
    limits = TEST_LIMITS | dict(max_streams=2, max_rest_jobs=1, capacity=2, max_channels=2)
    fronts = [LiveServer(model=model_path, step_server=step_server.address, **limits) for _ in range(2)]
    try:
        assert all(type(w.pool).__name__ == "RemoteLanePool" for f in fronts for w in f.scheduler.workers)
        results = [None, None]
        signals = [speechlike(16000 * 2, seed=s)[:, None] for s in (3, 4)]

        def go(i):
            results[i] = stream_through(fronts[i].ws_url, signals[i], 16000, "f32le", [320] * 100)[0]

        threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for x, y in zip(signals, results):
            assert_close_to_peak(y[:, 0], enhancer_rt.enhance(x[:, 0], 16000))
        assert all(httpx.get(f.base + "/readyz").status_code == 200 for f in fronts)
        step_server.stop()  # the front-ends are no longer ready (and say so to the load balancer)
        deadline = time.time() + 10
        while time.time() < deadline and any(httpx.get(f.base + "/readyz").status_code != 503 for f in fronts):
            time.sleep(0.1)
        assert all(httpx.get(f.base + "/readyz").status_code == 503 for f in fronts)
    finally:
        for f in fronts:
            f.stop()


def test_a_front_end_outlives_a_step_server_restart(model_path, tmp_path, enhancer_rt, monkeypatch):
    """The step server goes away: the call in flight fails, the stream's lanes are gone (its next
    call fails too), freeing them does not fail, `connected` is False; once a step server answers
    at the address again, the front-end reconnects and new streams step."""
    address = str(tmp_path / "restart.sock")
    hop = enhancer_rt.config.stft.hop
    x, g = np.zeros((1, hop), np.float32), np.zeros(1, np.float32)

    def start():
        srv = StepServer(address, model_path, device="cpu", lanes=4)
        t = threading.Thread(target=srv.serve_forever, daemon=True)
        t.start()
        return srv, t

    monkeypatch.setattr(RemoteLanePool, "RECONNECT_S", 0.0)  # reconnect at once (default: at most once a second)
    srv, t = start()
    pool = RemoteLanePool(address, 2, enhancer_rt.engine)
    lanes = pool.alloc(1)
    pool.step(lanes, x, g)
    srv.stop()
    t.join(timeout=5)
    with pytest.raises(StepServerError, match="went away|cannot reach"):
        pool.step(lanes, x, g)
    assert not pool.connected
    pool.free(lanes)  # never raises
    srv, t = start()
    try:
        assert pool.connected and pool.owned == 0
        with pytest.raises(StepServerError, match="not this front-end's"):
            pool.step(lanes if lanes[0] != 0 else lanes + 1, x, g)  # lanes of the old connection
        fresh = pool.alloc(1)
        assert pool.step(fresh, x, g).out.shape == (1, hop)
    finally:
        srv.stop()
        t.join(timeout=5)


def test_a_hung_step_server_fails_the_call_instead_of_hanging_the_front_end(tmp_path, enhancer_rt, monkeypatch):
    """A step server that accepts but never answers: the hello (and any call) gives up after
    ANSWER_S with a clear error."""
    from multiprocessing.connection import Listener

    monkeypatch.setattr(RemoteLanePool, "ANSWER_S", 0.3)
    listener = Listener(str(tmp_path / "hung.sock"), family="AF_UNIX")
    held = []
    t = threading.Thread(target=lambda: held.append(listener.accept()), daemon=True)
    t.start()
    t0 = time.time()
    with pytest.raises(StepServerError, match="did not answer in 0.3 s"):
        RemoteLanePool(str(tmp_path / "hung.sock"), 2, enhancer_rt.engine)
    assert time.time() - t0 < 5
    listener.close()
