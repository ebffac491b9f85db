"""Leaving the process group: all ranks meet at a barrier after a normal finish (a rank that tears
gloo down while rank 0 still writes the last checkpoint aborts), and never after an error (the other
ranks may never arrive)."""
from __future__ import annotations

import pytest
import torch.distributed

from training import loop
from training.distributed import Dist


class Recorder:
    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        monkeypatch.setattr(torch.distributed, "barrier", lambda *a, **k: self.calls.append("barrier"))
        monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda *a, **k: self.calls.append("destroy"))


def enabled_dist() -> Dist:
    d = Dist()  # WORLD_SIZE unset: no process group is made
    d.enabled, d.world = True, 2
    return d


def test_close_waits_for_the_other_ranks_only_after_a_normal_finish(monkeypatch):
    rec = Recorder(monkeypatch)
    enabled_dist().close()
    assert rec.calls == ["barrier", "destroy"]
    rec.calls.clear()
    enabled_dist().close(finished=False)
    assert rec.calls == ["destroy"]


@pytest.mark.parametrize("fails", [False, True])
def test_fit_closes_with_a_barrier_only_when_training_finished(monkeypatch, fails):
    rec = Recorder(monkeypatch)

    class FakeTrainer:
        def __init__(self, *args):
            pass

        def setup(self):
            pass

        def run(self):
            if fails:
                raise FloatingPointError("step 3: loss is nan")
            return {"step": 3}

    monkeypatch.setattr(loop, "Dist", enabled_dist)
    monkeypatch.setattr(loop, "Trainer", FakeTrainer)
    if fails:
        with pytest.raises(FloatingPointError):
            loop.fit(None, None)
        assert rec.calls == ["destroy"]
    else:
        assert loop.fit(None, None) == {"step": 3}
        assert rec.calls == ["barrier", "destroy"]
