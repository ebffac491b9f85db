"""A stream's state handed over through the step server (`RemoteLanePool.export_lanes` and
`import_lanes`, the wire's EXPORT and IMPORT): exported lanes imported into fresh ones step on as
the originals do, on a step server with a host pool or a device pool; only a front-end's own lanes
move; a malformed or foreign state is an ERROR reply, and the step server serves on."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from enhancer.engine import LanePool
from enhancer.pools import lane_shapes
from server.stepserver import RemoteLanePool, StepServer, StepServerError, pool, wire
from tests.server.test_stepserver import _raw_client

KEY = "test-lanes-key"


@pytest.fixture(params=[False, True], ids=["lane-pool", "device-pool"])
def step_server(request, model_path, tmp_path):
    srv = StepServer(str(tmp_path / "step.sock"), model_path, device="cpu", lanes=10, key=KEY, device_pool=request.param)
    assert type(srv.pool).__name__ == ("DeviceLanePool" if request.param else "LanePool")
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.stop()
    t.join(timeout=5)


def _hops(rng, k, frames, hop):
    return (rng.standard_normal((k, frames, hop)) * 0.1).astype(np.float32), rng.uniform(0, 0.3, k).astype(np.float32)


def _assert_same_steps(rng, hop, a, lanes_a, b, lanes_b):
    """Both sets of lanes step alike through the same hops (live steps and a multi-frame call)."""
    for frames in (1, 1, 5, 1):
        x, g = _hops(rng, len(lanes_a), frames, hop)
        ra, rb = a.run(lanes_a, x, g), b.run(lanes_b, x, g)
        assert np.abs(ra.out - rb.out).max() <= 1e-5 * max(float(np.abs(ra.out).max()), 1e-6)
        assert np.allclose(ra.activity, rb.activity, rtol=1e-5, atol=1e-6)


def _same_state(x: dict, y: dict) -> bool:
    return x.keys() == y.keys() and all(x[n].dtype == y[n].dtype and np.array_equal(x[n], y[n]) for n in x)


@pytest.mark.parametrize("one_lane_a_message", [False, True])
def test_exported_lanes_imported_into_fresh_ones_step_on_alike(step_server, enhancer_rt, rng, monkeypatch,
                                                               one_lane_a_message):
    """Front-end A's lanes, stepped past the attention window, exported and imported into fresh
    lanes of front-end B (in one message, or one lane a message): A's and B's lanes step alike; the
    state also moves to a local LanePool and back."""
    if one_lane_a_message:
        monkeypatch.setattr(pool, "STATE_BYTES", 1)
    hop = enhancer_rt.config.stft.hop
    a, b = (RemoteLanePool(step_server.address, 4, enhancer_rt.engine, KEY) for _ in range(2))
    la = a.alloc(3)
    for frames in (1, 7, 20, 1):
        a.run(la, *_hops(rng, 3, frames, hop))
    moving = la[[2, 0]]
    state = a.export_lanes(moving)
    assert {n: (x.shape, x.dtype) for n, x in state.items()} == lane_shapes(enhancer_rt.engine, 2)
    assert list(state["pos"]) == [29, 29]
    lb = b.alloc(3)
    b.run(lb, *_hops(rng, 3, 2, hop))
    b.import_lanes(lb[[1, 2]], state)
    assert _same_state(b.export_lanes(lb[[1, 2]]), state)
    _assert_same_steps(rng, hop, a, moving, b, lb[[1, 2]])

    local = LanePool(enhancer_rt.engine, 2)
    ll = local.alloc(2)
    local.import_lanes(ll, a.export_lanes(moving))
    _assert_same_steps(rng, hop, a, moving, local, ll)
    b.import_lanes(lb[[1, 2]], local.export_lanes(ll))
    _assert_same_steps(rng, hop, local, ll, b, lb[[1, 2]])
    empty = b.export_lanes(np.zeros(0, np.int64))
    assert all(x.shape[0] == 0 for x in empty.values())


def test_only_a_front_ends_own_lanes_move(step_server, enhancer_rt, rng):
    """Another front-end's lanes: refused by the front-end, and by the step server when asked
    directly; a state of the wrong shape: ValueError, nothing sent; the lanes as they were."""
    hop = enhancer_rt.config.stft.hop
    a, b = (RemoteLanePool(step_server.address, 4, enhancer_rt.engine, KEY) for _ in range(2))
    la, lb = a.alloc(2), b.alloc(2)
    a.run(la, *_hops(rng, 2, 3, hop))
    state = a.export_lanes(la)
    before = b.export_lanes(lb)
    with pytest.raises(StepServerError, match="not this front-end's"):
        b.import_lanes(la, before)
    with pytest.raises(StepServerError, match="not this front-end's"):
        b.export_lanes(la)
    with pytest.raises(StepServerError, match="not this front-end's"):  # the step server checks too
        b._call("import", la, before)
    with pytest.raises(StepServerError, match="not this front-end's"):
        b._call("export", la)
    assert _same_state(a.export_lanes(la), state)
    with pytest.raises(ValueError, match="expected"):
        b.import_lanes(lb, state | {"ola": state["ola"][:, :-1]})
    with pytest.raises(ValueError, match="lanes repeat"):
        b.import_lanes(lb[[0, 0]], state)
    assert _same_state(b.export_lanes(lb), before)


def test_a_malformed_import_is_an_error_reply_and_the_step_server_serves_on(step_server, enhancer_rt, rng,
                                                                              monkeypatch):
    """IMPORTs whose packed state does not unpack, or not to the model's arrays, or whose lanes
    repeat, and an EXPORT too big for one reply: each an ERROR reply on a connection that stays;
    the lanes keep their state and every front-end steps on."""
    hop = enhancer_rt.config.stft.hop
    good = RemoteLanePool(step_server.address, 2, enhancer_rt.engine, KEY)
    lg = good.alloc(1)
    good.run(lg, *_hops(rng, 1, 3, hop))
    raw = _raw_client(step_server.address, KEY)
    wire.send(raw, wire.request("alloc", 1, 2), 5)
    lanes = wire.recv(raw, 5).arrays[0]
    wire.send(raw, wire.request("export", 2, lanes), 5)
    reply = wire.recv(raw, 5)
    assert reply.kind == wire.OK
    state = wire.to_lane_state(reply)
    meta, packs = wire.pack_state({"pos": state["pos"]} | state)  # pos first, alone in pack 0
    floats = next(i for i, c in enumerate(dict.fromkeys(meta["dtypes"])) if wire.DTYPES[c] == np.float32)

    def with_packs(i, p):
        return tuple(p if j == i else q for j, q in enumerate(packs))

    bad = {
        "lists of one length": (meta | {"names": meta["names"][:-1]}, packs),
        "distinct strings": (meta | {"names": [meta["names"][0]] * len(meta["names"])}, packs),
        "unknown dtype codes": (meta | {"dtypes": [99] * len(meta["dtypes"])}, packs),
        "shapes must be": (meta | {"shapes": [[-1]] * len(meta["shapes"])}, packs),
        "expected one 1-D array": (meta, packs[:-1]),
        "runs past": (meta, with_packs(floats, packs[floats][:-1])),
        "hold more": (meta, with_packs(floats, np.concatenate([packs[floats], np.zeros(1, np.float32)]))),
        "float64": (meta, with_packs(floats, packs[floats].astype(np.float64))),
        # pos, the first array and the only int64 one (pack 0), left out: unpacks, but is not the model's state
        "has arrays": ({key: v[1:] for key, v in meta.items()}, packs[1:]),
        # pos of another (consistent) shape: unpacks, but is not the model's state either
        "expected": (meta | {"shapes": [[1], *meta["shapes"][1:]]}, with_packs(0, packs[0][:1])),
    }
    assert meta["names"][0] == "pos" and meta["dtypes"].count(meta["dtypes"][0]) == 1
    rid = 10
    for what, (m, p) in bad.items():
        rid += 1
        wire.send(raw, wire.Message(wire.IMPORT, rid, m, (np.asarray(lanes, np.int64), *p)), 5)
        reply = wire.recv(raw, 5)
        assert (reply.kind, reply.request) == (wire.ERROR, rid), (what, reply)
        assert what in reply.meta["error"], (what, reply.meta)
    wire.send(raw, wire.Message(wire.IMPORT, 40, meta, (np.asarray(lanes[[0, 0]], np.int64), *packs)), 5)
    assert "lanes repeat" in wire.recv(raw, 5).meta["error"]
    monkeypatch.setattr(wire, "MAX_STATE", 100)
    wire.send(raw, wire.request("export", 41, lanes), 5)
    assert "export fewer lanes" in wire.recv(raw, 5).meta["error"]
    monkeypatch.undo()
    wire.send(raw, wire.request("export", 42, lanes), 5)  # the same connection serves on; the lanes unchanged
    reply = wire.recv(raw, 5)
    assert reply.kind == wire.OK and _same_state(wire.to_lane_state(reply), state)
    wire.send(raw, wire.request("import", 43, lanes[::-1], state), 5)  # a good import is taken
    assert wire.recv(raw, 5).kind == wire.OK
    raw.close()
    assert good.step(lg, np.zeros((1, hop), np.float32), np.zeros(1, np.float32)).out.shape == (1, hop)
