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
