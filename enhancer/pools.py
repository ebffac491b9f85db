"""What a lane pool is: `LanePoolProtocol`, the interface every pool of per-stream state offers.

A lane pool holds the state of `capacity` lanes, each one channel of one stream; a stream takes
lanes (`alloc`), steps them (`run`: T hops at once; `step`: the live step, one hop) and gives them
back (`free`). Three classes implement it:

- `enhancer.engine.LanePool`: numpy caches on the host (the CPU provider);
- `enhancer.device_pool.DeviceLanePool`: caches in the session's device memory (CUDA), optionally
  with full-pool live steps (`full_step`);
- `server.stepserver.RemoteLanePool`: a front-end's lanes in a step server's pool, over a socket.

`enhancer.device_pool.make_pool` returns one for an engine; `StreamCursor`, `StreamingEnhancer`,
`enhancer bench` and the service's workers step whichever they are given. tests/enhancer/test_pools.py
checks that each class satisfies the protocol, member by member and signature by signature.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .step_io import check_lane_arrays, lane_shapes

if TYPE_CHECKING:
    import numpy as np

    from .engine import Engine, StepResult

__all__ = ["POOL_MEMBERS", "LanePoolProtocol", "check_lane_arrays", "lane_shapes"]


@runtime_checkable
class LanePoolProtocol(Protocol):
    """A pool of lanes of per-stream state that steps them in batches.

    Lanes are int64 arrays of distinct lane numbers in [0, capacity). Every call takes the lanes of
    one caller, and the pool's state changes only when a call succeeds (a failed `run` leaves the
    lanes as they were, so a batch may be retried part by part)."""

    engine: Engine  # the model (its config sets the hop, the states and rings)
    capacity: int  # lanes in all
    # the full-pool live step (`DeviceLanePool` with full_steps, when it could be built), else None
    full_step: Any

    @property
    def n_free(self) -> int:
        """Lanes not allocated now."""
        ...

    @property
    def connected(self) -> bool:
        """Whether the pool can step now: always for a local pool; for a remote one, whether its
        step server answers (asking may reconnect)."""
        ...

    def alloc(self, n: int) -> np.ndarray:
        """`n` free lanes, reset (fresh streams); RuntimeError when fewer are free."""
        ...

    def free(self, lanes) -> None:
        """Give `lanes` back; never fails."""
        ...

    def reset(self, lanes: np.ndarray) -> None:
        """Clear `lanes`' state: their next step is a new stream's first."""
        ...

    def run(self, lanes: np.ndarray, hops: np.ndarray, min_gain: np.ndarray) -> StepResult:
        """Advance `lanes` by T hops each in one call: hops (k, T, hop) -> out (k, T, hop), with
        `min_gain` (k,) each lane's gain floor; the same as T calls of `step`."""
        ...

    def step(self, lanes: np.ndarray, hops: np.ndarray, min_gain: np.ndarray) -> StepResult:
        """The live step: `lanes` by one hop each, hops (k, hop) -> out (k, hop)."""
        ...

    def export_lanes(self, lanes: np.ndarray) -> dict[str, np.ndarray]:
        """The state of `lanes` as host arrays (a stream's hand-off to another process): `pos` (k,)
        int64 and every cache of `enhancer.step_io.cache_specs` by name, (k, ...) each in the
        layout the step graph reads (`lane_shapes`)."""
        ...

    def import_lanes(self, lanes: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        """Set the state of `lanes` from `export_lanes`' arrays (of a pool of the same model);
        ValueError, and nothing changed, when a name, shape or dtype differs from `lane_shapes`."""
        ...


# the protocol's members: methods and properties, and the data attributes an instance carries
POOL_MEMBERS = ("engine", "capacity", "full_step", "n_free", "connected", "alloc", "free", "reset", "run", "step",
                "export_lanes", "import_lanes")
