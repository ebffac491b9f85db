"""One batched call of a lane pool over the lanes of several callers, and the one retry policy of
every hop the service steps (an inference worker's rounds and the step server's).

A live hop is a one-frame call like any other (hops (k, 1, hop)); a file's chunk or a late
stream's backlog has T frames. The parts of one call all have the same T. When the batched call
fails, each part is retried alone, a lone part too (a lane pool's state only changes when a call
succeeds), so a fault tied to one caller fails that caller only and a transient one fails none.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from enhancer.engine import StepResult

log = logging.getLogger("tim_enhancer.server")


@dataclass
class Part:
    """One caller's share of a batched call: its lanes (k,), hops (k, T, hop) and gain floors (k,)."""

    owner: Any  # who made it: a stream (a worker's round), a front-end's request (the step server's)
    lanes: np.ndarray
    hops: np.ndarray
    gains: np.ndarray


def rows(r: StepResult, a: int, b: int) -> StepResult:
    """Rows [a, b) of a call's result: one part's lanes."""
    return StepResult(out=r.out[a:b], competition=None if r.competition is None else r.competition[a:b],
                      activity=None if r.activity is None else r.activity[a:b])


def run_parts(run: Callable[[np.ndarray, np.ndarray, np.ndarray], StepResult], parts: list[Part],
              done: Callable[[Part, StepResult], None], failed: Callable[[Part, Exception], None]) -> None:
    """`run(lanes, hops, gains)` once over every part; `done(part, result)` with each part's rows.
    If the call fails, each part is run once more alone (a lone part too); `failed(part, error)` for
    a part that fails alone."""
    if not parts:
        return
    try:
        if len(parts) == 1:
            p = parts[0]
            r = run(p.lanes, p.hops, p.gains)
        else:
            r = run(np.concatenate([p.lanes for p in parts]), np.concatenate([p.hops for p in parts]),
                    np.concatenate([p.gains for p in parts]))
    except Exception as e:
        log.warning("a batched call of %d part(s) (%d frame(s)) failed (%s: %s): each alone", len(parts),
                    parts[0].hops.shape[1], type(e).__name__, e)
        for p in parts:
            try:
                alone = run(p.lanes, p.hops, p.gains)
            except Exception as err:
                failed(p, err)
                continue
            done(p, alone)
        return
    o = 0
    for p in parts:
        k = len(p.lanes)
        done(p, r if len(parts) == 1 else rows(r, o, o + k))
        o += k
