"""`enhancer.pools.LanePoolProtocol`: every lane pool class (the host's, the device's, the step
server's front-end) has each member of the protocol, its methods with the protocol's parameters,
and a live instance of each is an instance of the protocol."""
from __future__ import annotations

import inspect
import threading

import numpy as np

from enhancer.device_pool import DeviceLanePool, make_pool
from enhancer.engine import LanePool, Stepping
from enhancer.pools import POOL_MEMBERS, LanePoolProtocol

DATA = tuple(LanePoolProtocol.__annotations__)  # members an instance carries (set in __init__)


def _parameters(fn) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


def protocol_mismatches(cls: type) -> list[str]:
    """What `cls` lacks of the protocol, or has with other parameters (its data members are
    checked on instances)."""
    problems = []
    for name in POOL_MEMBERS:
        if name in DATA:
            continue
        want = inspect.getattr_static(LanePoolProtocol, name)
        got = inspect.getattr_static(cls, name, None)
        if got is None:
            problems.append(f"{name}: missing")
        elif isinstance(want, property):
            if callable(got) and not isinstance(got, property):
                problems.append(f"{name}: a method, not a property or attribute")
        elif not callable(got):
            problems.append(f"{name}: not a method")
        elif _parameters(getattr(cls, name)) != _parameters(want):
            problems.append(f"{name}{inspect.signature(getattr(cls, name))}: the protocol has "
                            f"{name}{inspect.signature(want)}")
    return problems


def test_the_protocol_names_every_member():
    members = {n for n, v in vars(LanePoolProtocol).items() if callable(v) or isinstance(v, property)}
    members = {n for n in members if not n.startswith("_")} | set(DATA)
    assert members == set(POOL_MEMBERS)


def test_each_pool_class_has_the_protocols_members_and_signatures():
    from server.stepserver import RemoteLanePool

    for cls in (LanePool, DeviceLanePool, RemoteLanePool):
        assert protocol_mismatches(cls) == [], cls.__name__


def test_the_check_sees_a_missing_member_or_another_signature():
    class NoReset(Stepping):
        capacity, n_free = 0, 0

        def alloc(self, n):
            return np.zeros(0, np.int64)

        def free(self, lanes):
            pass

        def run(self, lanes, hops):  # no min_gain
            raise NotImplementedError

    problems = protocol_mismatches(NoReset)
    assert "reset: missing" in problems and any(p.startswith("run(") for p in problems), problems


def test_live_pools_are_lane_pools(enhancer_rt):
    eng = enhancer_rt.engine
    pools = [make_pool(eng, 2), make_pool(eng, 2, device_pool=True), make_pool(eng, 2, full_steps=True, device_pool=True)]
    assert [type(p) for p in pools] == [LanePool, DeviceLanePool, DeviceLanePool]
    for pool in pools:
        assert isinstance(pool, LanePoolProtocol), type(pool).__name__
        assert pool.engine is eng and pool.capacity == 2 and pool.connected and pool.n_free == 2
    assert pools[0].full_step is None and pools[1].full_step is None and pools[2].full_step is not None
    assert not isinstance(object(), LanePoolProtocol)


def test_a_remote_pool_is_a_lane_pool(model_path, enhancer_rt, tmp_path):
    from server.stepserver import RemoteLanePool, StepServer

    srv = StepServer(str(tmp_path / "step.sock"), model_path, device="cpu", lanes=4, key="pool-key")
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        pool = RemoteLanePool(srv.address, 2, enhancer_rt.engine, "pool-key")
        assert isinstance(pool, LanePoolProtocol)
        assert pool.engine is enhancer_rt.engine and pool.capacity == 2 and pool.full_step is None and pool.connected
        lanes = pool.alloc(1)
        hop = enhancer_rt.config.stft.hop
        assert pool.step(lanes, np.zeros((1, hop), np.float32), np.zeros(1, np.float32)).out.shape == (1, hop)
        pool.free(lanes)
        pool.close()
    finally:
        srv.stop()
        t.join(timeout=5)
