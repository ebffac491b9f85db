"""The step server (one process runs the model for several service processes) and `RemoteLanePool`:
remote steps equal local ones, lanes stay each front-end's own, a disconnect frees them, two
services stepping through one step server each stream correctly (on the CPU provider); its wire
format round-trips every message and refuses malformed frames; it needs a shared key, refuses a
front-end with another one, and drops a client that sends garbage while serving the others."""
from __future__ import annotations

import socket
import struct
import threading
import time

import httpx
import numpy as np
import pytest

from enhancer.engine import LanePool, StepResult
from enhancer.errors import EnhancerError
from server.settings import Settings
from server.stepserver import RemoteLanePool, StepServer, StepServerError, auth, wire
from tests.conftest import speechlike
from tests.server.conftest import TEST_LIMITS, LiveServer
from tests.server.test_ws import stream_through
from tests.tolerance import assert_close_to_peak

KEY = "test-step-key"


@pytest.fixture
def step_server(model_path, tmp_path):
    srv = StepServer(str(tmp_path / "step.sock"), model_path, device="cpu", lanes=12, key=KEY)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.stop()
    t.join(timeout=5)


def test_two_front_ends_step_as_a_local_pool_would(step_server, enhancer_rt, rng):
    """Two clients step their streams at once (the step server batches them in rounds); each
    stream's output equals the same inputs through a local LanePool."""
    hop = enhancer_rt.config.stft.hop
    clients = [RemoteLanePool(step_server.address, 4, enhancer_rt.engine, KEY) for _ in range(2)]
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
    a, b = (RemoteLanePool(step_server.address, 4, enhancer_rt.engine, KEY) for _ in range(2))
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
    c = RemoteLanePool(step_server.address, 6, enhancer_rt.engine, KEY)
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
        RemoteLanePool(step_server.address, 2, engine, KEY)


def test_no_step_server_is_a_clear_error(tmp_path, enhancer_rt):
    with pytest.raises(StepServerError, match="cannot reach the step server"):
        RemoteLanePool(str(tmp_path / "nobody.sock"), 2, enhancer_rt.engine, KEY)


def test_two_services_stream_through_one_step_server(step_server, model_path, enhancer_rt):
    """Two services (front-ends) on one step server: a stream through each gets its offline output."""
    limits = TEST_LIMITS | dict(max_streams=2, max_rest_jobs=1, capacity=2, max_channels=2)
    fronts = [LiveServer(model=model_path, step_server=step_server.address, step_key=KEY, **limits) for _ in range(2)]
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
        srv = StepServer(address, model_path, device="cpu", lanes=4, key=KEY)
        t = threading.Thread(target=srv.serve_forever, daemon=True)
        t.start()
        return srv, t

    monkeypatch.setattr(RemoteLanePool, "RECONNECT_S", 0.0)  # reconnect at once (default: at most once a second)
    srv, t = start()
    pool = RemoteLanePool(address, 2, enhancer_rt.engine, KEY)
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
    """A step server that accepts but never answers: the handshake (and any call) gives up after
    ANSWER_S with a clear error."""
    monkeypatch.setattr(RemoteLanePool, "ANSWER_S", 0.3)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "hung.sock"))
    listener.listen()
    held = []
    t = threading.Thread(target=lambda: held.append(listener.accept()), daemon=True)
    t.start()
    t0 = time.time()
    with pytest.raises(StepServerError, match="did not answer in 0.3 s"):
        RemoteLanePool(str(tmp_path / "hung.sock"), 2, enhancer_rt.engine, KEY)
    assert time.time() - t0 < 5
    listener.close()


# the wire format

def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-exact: dtype, shape and every byte."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_every_message_kind_round_trips_through_the_wire(rng):
    """Each request, reply and handshake message decodes to what was encoded: kind, request id,
    meta, and arrays bit-exact with their dtypes and shapes (NaN, inf, empty, non-contiguous too)."""
    hops = rng.standard_normal((3, 2, 256)).astype(np.float32)
    hops[0, 0, :3] = [np.nan, np.inf, -0.0]
    lanes, gains = np.array([5, 0, 11], np.int64), rng.random(3).astype(np.float32)
    r = StepResult(out=hops[:, :, ::2], competition=rng.random((3, 2, 5, 2)).astype(np.float32),
                   activity=rng.random((3, 2)).astype(np.float32))
    others = (np.arange(6, dtype=np.int32).reshape(2, 3), np.zeros((0, 4), np.float64), np.float16([1.5, -2]),
              np.uint8([0, 255]), np.float32(3.25), np.int8([-128, 0, 127]))
    state = {"pos": np.array([3, 40, 7], np.int64), "prev_hop": hops[:, 0, :8], "k0": np.int8([[[-128, 5], [0, 127]]] * 3),
             "v0": rng.standard_normal((3, 2, 2, 2)).astype(np.float32), "empty": np.zeros((3, 0), np.float32)}
    messages = [wire.Message(wire.CHALLENGE, meta={"nonce": "ab" * 32}),
                wire.Message(wire.PROOF, meta={"mac": "cd" * 32, "nonce": "ef" * 32}),
                wire.Message(wire.WELCOME, meta={"mac": "01" * 32}),
                wire.request("hello", 1), wire.request("alloc", 2, 4), wire.request("free", 3, [1, 2]),
                wire.request("reset", 4, np.array([7], np.int64)), wire.request("run", 2**32 - 1, lanes, hops, gains),
                wire.ok(5, {"config": {"stft": {"hop": 256}, "rise_limit_snr_db": [-6.0, 3.0]}, "lanes": 12}),
                wire.ok(6, arrays=(lanes,)), wire.result(7, r),
                wire.result(8, StepResult(out=r.out, competition=None, activity=r.activity)),
                wire.error(9, "ValueError: lanes [3] are not this front-end's \u2013 \u00e9"),
                wire.Message(wire.OK, 10, arrays=others),
                wire.request("export", 11, lanes), wire.request("import", 12, lanes, state), wire.lane_state(13, state)]
    assert {m.kind for m in messages} == set(wire.KINDS)
    for m in messages:
        got = wire.decode(wire.frame(m))
        assert (got.kind, got.request, got.meta) == (m.kind, m.request, m.meta)
        assert len(got.arrays) == len(m.arrays)
        assert all(_same(np.asarray(a), b) for a, b in zip(m.arrays, got.arrays))
        if got.kind in wire.REQUESTS:
            wire.check_request(got)
    back = wire.to_result(wire.decode(wire.frame(wire.result(7, r))))
    assert all(_same(getattr(r, f), getattr(back, f)) for f in ("out", "competition", "activity"))
    assert wire.to_result(wire.decode(wire.frame(messages[11]))).competition is None
    for m in messages[-2:]:  # a lane state: its arrays bit-exact, in order, from one pack per dtype
        got = wire.to_lane_state(wire.decode(wire.frame(m)))
        assert list(got) == list(state) and all(_same(state[n], got[n]) for n in state)
        assert len(m.arrays) == 3 + (m.kind == wire.IMPORT)  # int64, float32, int8 (+ the lanes)


def _header(kind=wire.OK, arrays=0, request=0, meta_len=0, body_len=0, magic=wire.MAGIC, version=wire.VERSION):
    return wire.HEADER.pack(magic, version, kind, arrays, request, meta_len, body_len)


def test_malformed_frames_are_protocol_errors():
    good = wire.frame(wire.request("run", 1, np.arange(2), np.zeros((2, 1, 4), np.float32), np.zeros(2, np.float32)))
    hops_desc = wire.HEADER.size + wire.ARRAY.size  # the descriptor of the hops: code, ndim, 2 zero bytes, dims
    bad = {
        "bad magic": b"XXXX" + good[4:],
        "protocol version": good[:4] + bytes([9]) + good[5:],
        "unknown message kind": good[:5] + bytes([200]) + good[6:],
        "at most": _header(body_len=wire.MAX_MESSAGE + 1),  # oversized: refused from the header alone
        "arrays in one message": _header(arrays=wire.MAX_ARRAYS + 1, body_len=1000),
        "meta of": _header(meta_len=wire.MAX_META + 1, body_len=wire.MAX_META + 8),
        "cannot hold": _header(arrays=2, meta_len=4, body_len=8),
        "truncated": good[:-5],
        "truncated header": good[:7],
        "trailing bytes": good + b"\0" * 8,
        # the hops' shape claims more than the frame holds (body length unchanged)
        "needs": good[:hops_desc + 8] + struct.pack("<I", 2000) + good[hops_desc + 12:],
        # ... or less: the bytes left over do not match
        "its arrays and meta take": good[:hops_desc + 12] + struct.pack("<I", 1) + good[hops_desc + 16:],
        "unknown dtype code": good[:hops_desc] + bytes([99]) + good[hops_desc + 1:],
        "bad dimensions": good[:hops_desc + 1] + bytes([7]) + good[hops_desc + 2:],
        "not JSON": _header(meta_len=3, body_len=8) + b"{x}" + b"\0" * 5,
        "not an object": _header(meta_len=2, body_len=8) + b"[]" + b"\0" * 6,
    }
    for what, raw in bad.items():
        with pytest.raises(wire.ProtocolError, match=what):
            wire.decode(raw)
    with pytest.raises(ValueError):  # a ProtocolError is a ValueError
        wire.decode(b"")
    with pytest.raises(wire.ProtocolError, match="at most 4096"):  # the handshake's own limit
        wire.decode(_header(body_len=5000), limit=4096)
    for m, what in [(wire.ok(1), "where a request was due"), (wire.Message(wire.ALLOC, meta={"n": -1}), "alloc of"),
                    (wire.Message(wire.FREE, arrays=(np.float32([1]),)), "lanes must be"),
                    (wire.request("run", 1, [0], np.zeros((1, 0, 4)), [0]), "hops must be"),
                    (wire.Message(wire.RUN, arrays=(np.arange(2), np.zeros((2, 1, 4), np.float64), np.zeros(2))),
                     "hops must be"),
                    (wire.Message(wire.RESET), "with 0 arrays"), (wire.Message(wire.IMPORT), "with 0 arrays"),
                    (wire.Message(wire.EXPORT, arrays=(np.arange(2), np.arange(2))), "with 2 arrays"),
                    (wire.Message(wire.IMPORT, arrays=(np.int32([1]), np.float32([1]))), "lanes must be")]:
        with pytest.raises(wire.ProtocolError, match=what):
            wire.check_request(wire.decode(wire.frame(m)))
    with pytest.raises(wire.ProtocolError, match="cannot be sent"):
        wire.frame(wire.Message(wire.OK, arrays=(np.array(["x"]),)))


def test_a_frame_cut_short_on_a_socket_is_an_error():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(wire.frame(wire.request("alloc", 1, 2))[:-3])
        a.close()
        with pytest.raises(ConnectionError):
            wire.recv(b, 2.0)


# the key

def test_the_step_server_refuses_to_start_without_a_key(model_path, tmp_path, monkeypatch, capsys):
    from enhancer.cli import main as enhancer_main
    from server.cli import read_key

    with pytest.raises(EnhancerError, match="--key-file PATH or \\$TIM_ENHANCER_STEP_KEY"):
        StepServer(str(tmp_path / "s.sock"), model_path, device="cpu", lanes=2)
    monkeypatch.delenv("TIM_ENHANCER_STEP_KEY", raising=False)
    assert enhancer_main(["step-server", "--address", str(tmp_path / "s.sock"), "--model", str(model_path)]) == 2
    assert "--key-file" in capsys.readouterr().err
    assert not (tmp_path / "s.sock").exists()
    (tmp_path / "key").write_text("s3cret\n")
    assert read_key(str(tmp_path / "key"), "--key-file") == "s3cret"
    monkeypatch.setenv("TIM_ENHANCER_STEP_KEY", "from-env")
    assert read_key(None, "--key-file") == "from-env"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(EnhancerError, match="holds no key"):
        read_key(str(tmp_path / "empty"), "--key-file")


def test_a_step_server_front_end_needs_a_key(monkeypatch):
    monkeypatch.delenv("TIM_ENHANCER_STEP_KEY", raising=False)
    with pytest.raises(ValueError, match="step_server needs step_key.*--step-key-file"):
        Settings.build(step_server="/run/tim/step.sock")
    assert Settings.build(step_server="/run/tim/step.sock", step_key="k").step_key == "k"
    monkeypatch.setenv("TIM_ENHANCER_STEP_KEY", "from-env")
    assert Settings.build(step_server="/run/tim/step.sock").step_key == "from-env"


def _wait(cond, seconds=5.0) -> bool:
    deadline = time.time() + seconds
    while not cond() and time.time() < deadline:
        time.sleep(0.02)
    return cond()


def test_a_front_end_with_another_key_is_refused_and_the_others_step_on(step_server, enhancer_rt, caplog):
    hop = enhancer_rt.config.stft.hop
    x, g = np.zeros((1, hop), np.float32), np.zeros(1, np.float32)
    good = RemoteLanePool(step_server.address, 2, enhancer_rt.engine, KEY)
    lanes = good.alloc(1)
    want = good.step(lanes, x + 0.1, g).out
    with caplog.at_level("WARNING", logger="tim_enhancer.stepserver"):
        with pytest.raises(StepServerError, match="refused the key"):
            RemoteLanePool(step_server.address, 2, enhancer_rt.engine, "another key")
        assert _wait(lambda: "refused a connection" in caplog.text)
    assert good.step(lanes, x, g).out.shape == (1, hop)
    again = RemoteLanePool(step_server.address, 2, enhancer_rt.engine, KEY)
    assert np.array_equal(again.step(again.alloc(1), x + 0.1, g).out, want)  # a fresh lane: the first step's output


def _raw_client(address: str, key: str = KEY) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(address)
    auth.answer(s, auth.as_key(key), 5)
    return s


def _closed_by_peer(s: socket.socket, seconds: float = 5.0) -> bool:
    """Whether the other end closes `s` within `seconds` (a reset counts: it closed with our bytes unread)."""
    s.settimeout(seconds)
    try:
        while s.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


def test_a_client_sending_garbage_is_dropped_and_the_server_serves_on(step_server, enhancer_rt, caplog, monkeypatch):
    """Garbage before the handshake, a malformed frame or a message that is no request after it, a
    connection that never answers the challenge: each is dropped (its lanes freed), logged, and the
    step server steps the other front-ends on."""
    from server.stepserver import fronts

    hop = enhancer_rt.config.stft.hop
    good = RemoteLanePool(step_server.address, 2, enhancer_rt.engine, KEY)
    lanes = good.alloc(1)
    with caplog.at_level("WARNING", logger="tim_enhancer.stepserver"):
        pre = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        pre.connect(step_server.address)
        pre.sendall(b"\x80\x04\x95 not a frame at all, and a pickle opcode or two" * 4)
        assert _closed_by_peer(pre)

        raw = _raw_client(step_server.address)
        wire.send(raw, wire.request("alloc", 1, 3), 5)
        assert wire.recv(raw, 5).arrays[0].shape == (3,)
        assert step_server.pool.n_free == 12 - 1 - 3
        raw.sendall(b"GARBAGE!" * 8)
        assert _closed_by_peer(raw)
        assert _wait(lambda: step_server.pool.n_free == 12 - 1)  # its lanes came back

        odd = _raw_client(step_server.address)
        wire.send(odd, wire.ok(1), 5)  # a reply where a request is due
        assert _closed_by_peer(odd)

        monkeypatch.setattr(fronts, "HANDSHAKE_S", 0.3)
        silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        silent.connect(step_server.address)
        t0 = time.time()
        assert _closed_by_peer(silent) and time.time() - t0 < 3
        assert _wait(lambda: "did not complete the handshake" in caplog.text)
    assert "malformed message" in caplog.text and "dropped a connection in its handshake" in caplog.text
    assert good.step(lanes, np.zeros((1, hop), np.float32), np.zeros(1, np.float32)).out.shape == (1, hop)
    assert good.connected


def test_the_handshake_proves_the_key_both_ways():
    """Same key: both sides pass. Another key: the step server refuses (and says so). A peer that
    answers the challenge without the key fails the front-end's check of it."""
    def both(server_key: bytes, client_key: bytes, serve=auth.challenge):
        a, b = socket.socketpair()
        errors = {}

        def side(name, fn, sock, key):
            try:
                fn(sock, key, 2.0)
            except Exception as e:  # noted for the assertions
                errors[name] = e

        t = threading.Thread(target=side, args=("server", serve, a, server_key))
        t.start()
        side("client", auth.answer, b, client_key)
        t.join(5)
        a.close()
        b.close()
        return errors

    assert both(b"k", b"k") == {}
    errors = both(b"k", b"other")
    assert isinstance(errors["server"], auth.KeyRefused) and isinstance(errors["client"], auth.KeyRefused)
    assert str(errors["client"]) == auth.REFUSED

    def impostor(sock, key, timeout):  # sends a challenge, takes any proof, welcomes with a made-up MAC
        wire.send(sock, wire.Message(wire.CHALLENGE, meta={"nonce": "00" * 32}), timeout)
        wire.recv(sock, timeout)
        wire.send(sock, wire.Message(wire.WELCOME, meta={"mac": "11" * 32}), timeout)

    errors = both(b"k", b"k", serve=impostor)
    assert isinstance(errors["client"], auth.KeyRefused) and "did not prove" in str(errors["client"])
