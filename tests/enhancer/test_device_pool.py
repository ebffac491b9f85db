"""`DeviceLanePool` (caches bound in place, updated by the lane graphs) against `LanePool` (numpy
caches), on the CPU provider: the same calls give the same outputs. Under CUDA the same code runs
with device buffers (`tools/gpu_check.py` repeats this comparison there)."""
from __future__ import annotations

import numpy as np
import pytest

from enhancer import lane_graphs
from enhancer.build.lane_graphs import build as build_lane_graphs
from enhancer.device_pool import DeviceLanePool, make_pool
from enhancer.engine import LanePool
from enhancer.errors import CheckpointError


def test_lane_graph_files_are_what_build_writes():
    for name, proto in build_lane_graphs().items():
        assert lane_graphs.path(name).read_bytes() == proto.SerializeToString(deterministic=True), name


def _pools(enhancer_rt, capacity, full_steps=False):
    return LanePool(enhancer_rt.engine, capacity), DeviceLanePool(enhancer_rt.engine, capacity, full_steps=full_steps)


@pytest.mark.parametrize("full_steps", [False, True])
def test_device_pool_matches_lane_pool(enhancer_rt, rng, full_steps):
    """Live steps and multi-frame calls, lane subsets with gaps, a lane freed and reused mid-way:
    every output equal (the same graph computes both; with `full_steps` the live steps run over the
    whole pool in a static session of it)."""
    cfg = enhancer_rt.config
    hop = cfg.stft.hop
    host, dev = _pools(enhancer_rt, 6, full_steps)
    assert (dev.full_step is not None) == full_steps
    lanes_h, lanes_d = host.alloc(5), dev.alloc(5)
    assert np.array_equal(lanes_h, lanes_d)
    calls = [(np.arange(5), 1)] * 3 + [(np.array([0, 2, 4]), 1), (np.array([1, 3]), 4), (np.arange(5), 19),
                                       (np.array([4]), 1), (np.arange(5), 1)]
    for i, (which, frames) in enumerate(calls * 3):
        if i == 10:  # lane 2 ends; a new stream takes it, fresh
            for p in (host, dev):
                p.free([2])
            assert np.array_equal(host.alloc(1), dev.alloc(1))
        x = (rng.standard_normal((len(which), frames, hop)) * 0.1).astype(np.float32)
        g = rng.uniform(0, 0.3, len(which)).astype(np.float32)
        a = host.run(lanes_h[which], x, g)
        b = dev.run(lanes_d[which], x, g)
        scale = max(float(np.abs(a.out).max()), 1e-6)
        assert np.abs(a.out - b.out).max() <= 1e-5 * scale, (i, which, frames)
        assert np.allclose(a.activity, b.activity, rtol=1e-5, atol=1e-6)
        if a.competition is not None:
            assert np.allclose(a.competition, b.competition, rtol=1e-5, atol=1e-6)
    assert np.array_equal(host.pos, dev.pos)


def test_device_pool_reset_gives_a_fresh_stream(enhancer_rt, rng):
    """A lane that was used, reset, steps exactly as a lane never used."""
    hop = enhancer_rt.config.stft.hop
    dev = DeviceLanePool(enhancer_rt.engine, 2)
    lanes = dev.alloc(2)
    for _ in range(5):
        dev.step(lanes, (rng.standard_normal((2, hop)) * 0.3).astype(np.float32), np.zeros(2, np.float32))
    dev.reset(lanes[:1])
    x = (rng.standard_normal((1, hop)) * 0.1).astype(np.float32)
    fresh = LanePool(enhancer_rt.engine, 1)
    want = fresh.step(fresh.alloc(1), x, np.zeros(1, np.float32)).out
    got = dev.step(lanes[:1], x, np.zeros(1, np.float32)).out
    assert np.abs(got - want).max() <= 1e-5 * max(float(np.abs(want).max()), 1e-6)


def test_make_pool_keeps_the_cpu_on_lane_pool(enhancer_rt, monkeypatch):
    assert type(make_pool(enhancer_rt.engine, 2)) is LanePool
    pool = make_pool(enhancer_rt.engine, 2, device_pool=True)
    assert type(pool) is DeviceLanePool and pool.full_step is None
    pool = make_pool(enhancer_rt.engine, 2, full_steps=True, device_pool=True)
    assert type(pool) is DeviceLanePool and pool.full_step is not None


def test_make_pool_reads_no_environment(enhancer_rt, monkeypatch):
    """The switches are arguments: the variables the command line reads change nothing here."""
    monkeypatch.setenv("TIM_ENHANCER_DEVICE_POOL", "1")
    monkeypatch.setenv("TIM_ENHANCER_FULL_STEPS", "1")
    assert type(make_pool(enhancer_rt.engine, 2)) is LanePool
    pool = make_pool(enhancer_rt.engine, 2, device_pool=True)
    assert type(pool) is DeviceLanePool and pool.full_step is None


def test_device_pool_refuses_int8_rings(enhancer_rt, monkeypatch):
    monkeypatch.setattr(type(enhancer_rt.engine), "int8_rings", property(lambda self: True))
    with pytest.raises(CheckpointError, match="int8 key/value rings"):
        DeviceLanePool(enhancer_rt.engine, 2)


# a stream's state handed out and taken in (`export_lanes`, `import_lanes`)

def _hops(rng, k, frames, hop):
    return (rng.standard_normal((k, frames, hop)) * 0.1).astype(np.float32), rng.uniform(0, 0.3, k).astype(np.float32)


def _assert_same_steps(rng, hop, a, lanes_a, b, lanes_b, calls=((1, 3), (4, 1), (1, 2))):
    """`a`'s lanes and `b`'s step alike through the same hops (live steps and multi-frame calls):
    outputs equal within the device-vs-host pool tolerance."""
    for frames, times in calls:
        for _ in range(times):
            x, g = _hops(rng, len(lanes_a), frames, hop)
            ra, rb = a.run(lanes_a, x, g), b.run(lanes_b, x, g)
            scale = max(float(np.abs(ra.out).max()), 1e-6)
            assert np.abs(ra.out - rb.out).max() <= 1e-5 * scale
            assert np.allclose(ra.activity, rb.activity, rtol=1e-5, atol=1e-6)


def _same_state(x: dict, y: dict) -> bool:
    return x.keys() == y.keys() and all(x[n].dtype == y[n].dtype and np.array_equal(x[n], y[n]) for n in x)


@pytest.mark.parametrize("full_steps", [False, True])
def test_exported_lanes_step_on_in_another_device_pool(enhancer_rt, rng, full_steps):
    """Lanes stepped past the attention window, exported (in the layout `lane_shapes` gives) and
    imported into other lanes of another device pool: both step on alike; the lanes around the
    imported ones are untouched, and a second export gives the same arrays back."""
    from enhancer.pools import lane_shapes

    hop = enhancer_rt.config.stft.hop
    src = DeviceLanePool(enhancer_rt.engine, 5, full_steps=full_steps)
    lanes = src.alloc(5)
    for frames in (1, 1, 7, 20, 1):
        src.run(lanes, *_hops(rng, 5, frames, hop))
    moving = lanes[[3, 1]]
    state = src.export_lanes(moving)
    want = lane_shapes(enhancer_rt.engine, 2)
    assert {n: (a.shape, a.dtype) for n, a in state.items()} == want
    assert list(state["pos"]) == [30, 30]
    dst = DeviceLanePool(enhancer_rt.engine, 6, full_steps=full_steps)
    dst_lanes = dst.alloc(6)
    for _ in range(2):
        dst.run(dst_lanes, *_hops(rng, 6, 1, hop))
    around = dst.export_lanes(dst_lanes[[0, 2, 3, 5]])
    dst.import_lanes(dst_lanes[[4, 1]], state)
    assert _same_state(dst.export_lanes(dst_lanes[[4, 1]]), state)
    assert _same_state(dst.export_lanes(dst_lanes[[0, 2, 3, 5]]), around)
    _assert_same_steps(rng, hop, src, moving, dst, dst_lanes[[4, 1]])


def test_lanes_move_between_device_and_host_pools(enhancer_rt, rng):
    """Device pool -> LanePool of the same model -> device pool: the same arrays, the same steps."""
    hop = enhancer_rt.config.stft.hop
    dev = DeviceLanePool(enhancer_rt.engine, 3)
    lanes = dev.alloc(3)
    for frames in (1, 5, 19, 1):
        dev.run(lanes, *_hops(rng, 3, frames, hop))
    host = LanePool(enhancer_rt.engine, 4)
    host_lanes = host.alloc(4)
    state = dev.export_lanes(lanes[1:])
    host.import_lanes(host_lanes[[2, 0]], state)
    assert _same_state(host.export_lanes(host_lanes[[2, 0]]), state)
    _assert_same_steps(rng, hop, dev, lanes[1:], host, host_lanes[[2, 0]])
    back = DeviceLanePool(enhancer_rt.engine, 2)
    back_lanes = back.alloc(2)
    back.import_lanes(back_lanes, host.export_lanes(host_lanes[[2, 0]]))
    _assert_same_steps(rng, hop, host, host_lanes[[2, 0]], back, back_lanes)


def test_exports_and_imports_are_copied_in_parts(enhancer_rt, rng, monkeypatch):
    """Copies of at most COPY_CHUNK_BYTES per call (here: one lane a call) give the same arrays."""
    from enhancer import device_pool

    hop = enhancer_rt.config.stft.hop
    pool = DeviceLanePool(enhancer_rt.engine, 4)
    lanes = pool.alloc(4)
    for frames in (3, 1):
        pool.run(lanes, *_hops(rng, 4, frames, hop))
    whole = pool.export_lanes(lanes[::-1])
    monkeypatch.setattr(device_pool, "COPY_CHUNK_BYTES", 1)
    assert _same_state(pool.export_lanes(lanes[::-1]), whole)
    other = DeviceLanePool(enhancer_rt.engine, 4)
    other.import_lanes(other.alloc(4), whole)
    assert _same_state(other.export_lanes(np.arange(4)), whole)
    empty = pool.export_lanes(np.zeros(0, np.int64))
    assert all(a.shape[0] == 0 for a in empty.values())
    pool.import_lanes(np.zeros(0, np.int64), empty)


def test_a_bad_import_raises_and_changes_nothing(enhancer_rt, rng):
    """A wrong shape, dtype or name, or lanes out of the pool or repeated: ValueError, the lanes as they were."""
    hop = enhancer_rt.config.stft.hop
    pool = DeviceLanePool(enhancer_rt.engine, 3)
    lanes = pool.alloc(3)
    pool.run(lanes, *_hops(rng, 3, 4, hop))
    before = pool.export_lanes(lanes)
    good = pool.export_lanes(lanes[:2])
    fresh = {n: np.zeros_like(a) for n, a in good.items()}
    ring = next(n for n in good if n.startswith("v"))
    bad = {
        "expected": fresh | {ring: fresh[ring][:, :, :-1]},  # a shape
        "float64": fresh | {"prev_hop": fresh["prev_hop"].astype(np.float64)},  # a dtype
        "has arrays": {n: a for n, a in fresh.items() if n != "ola"},  # a name missing
        "int64": fresh | {"pos": fresh["pos"].astype(np.int32)},
    }
    for what, arrays in bad.items():
        with pytest.raises(ValueError, match=what):
            pool.import_lanes(lanes[:2], arrays)
    with pytest.raises(ValueError, match="lanes must be in"):
        pool.import_lanes(np.array([0, 3]), fresh)
    with pytest.raises(ValueError, match="lanes repeat"):
        pool.import_lanes(np.array([1, 1]), fresh)
    with pytest.raises(ValueError, match="lanes must be in"):
        pool.export_lanes(np.array([-1]))
    assert _same_state(pool.export_lanes(lanes), before)
