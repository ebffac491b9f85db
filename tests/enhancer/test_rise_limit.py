"""The rise limit (`enhancer.build.model.postfilter`): its arithmetic against a direct numpy reference, and
the same output from the offline torch reference, the torch step hop by hop and in chunks, the
exported graph through the runtime (files, streams in random chunks, batched lanes) and the CLI."""
import copy
import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from enhancer import ModelConfig
from enhancer.build.model.postfilter import decay, rise_limit
from enhancer.step_io import state_specs
from tests.conftest import assert_lanes_match_offline, check_export_flag, runtime_of, speechlike
from tests.enhancer.test_streaming import random_chunks, stream_through, torch_streaming
from tests.tolerance import assert_close_to_peak, assert_differs

CFG = ModelConfig.preset("tim", rise_limit_gain=0.3)


def reference(cfg, gains, power):
    """The rise limit written frame by frame, from a fresh stream."""
    a = decay(cfg)
    lo, hi = cfg.rise_limit_snr_db
    kept_e = removed_e = 0.0
    prev = np.zeros(gains.shape[1])
    out = np.empty_like(gains)
    for t, (g, p) in enumerate(zip(gains, power)):
        kept = float((g * g * p).sum())
        kept_e = a * kept_e + (1 - a) * kept
        removed_e = a * removed_e + (1 - a) * max(float(p.sum()) - kept, 0.0)
        snr = 10 * math.log10((kept_e + 1e-9) / (removed_e + 1e-9))
        w = min(max((hi - snr) / (hi - lo), 0.0), 1.0)
        limited = np.where(g < cfg.rise_limit_gain, np.minimum(g, prev), g)
        out[t] = g - w * (g - limited)
        prev = g
    return out


def test_matches_the_frame_by_frame_reference_in_any_chunking():
    rng = np.random.default_rng(0)
    t, f = 90, CFG.n_freqs
    gains = rng.uniform(0, 1, (t, f)) ** 3
    power = rng.uniform(0, 1, (t, f)) * np.where(np.arange(t) < 45, 1.0, 100.0)[:, None]  # a quiet, then loud input
    ref = reference(CFG, gains, power)
    g, p = torch.from_numpy(gains)[None], torch.from_numpy(power)[None]
    whole = rise_limit(CFG, g, p, torch.zeros(1, f, dtype=g.dtype), torch.zeros(1, 2, dtype=g.dtype))[0][0].numpy()
    np.testing.assert_allclose(whole, ref, rtol=1e-9, atol=0)
    state, parts, s = [torch.zeros(1, f, dtype=g.dtype), torch.zeros(1, 2, dtype=g.dtype)], [], 0
    for k in (1, 7, 30, 2, 50):
        part, *state = rise_limit(CFG, g[:, s:s + k], p[:, s:s + k], *state)
        parts.append(part[0].numpy())
        s += k
    np.testing.assert_allclose(np.concatenate(parts), ref, rtol=1e-9, atol=0)


def test_offline_reference_runs_long_inputs_in_chunks(torch_model):
    """`TIMNet.output_gain` runs the limit in chunks of `LIMIT_FRAMES` (its cost grows with T^2 per
    call); the result is the frame-by-frame reference's, then raised to the exponent."""
    from enhancer.build.model.net import LIMIT_FRAMES

    model = copy.deepcopy(torch_model)
    model.config = dataclasses.replace(model.config, rise_limit_gain=0.5, gain_exponent=1.25)
    rng = np.random.default_rng(3)
    t = 2 * LIMIT_FRAMES + 37
    gains = rng.uniform(0, 1, (t, model.config.n_freqs)) ** 2
    power = rng.uniform(0, 1, gains.shape) * rng.uniform(0.01, 10, (t, 1))
    got = model.output_gain(torch.from_numpy(gains)[None], torch.from_numpy(power)[None])[0].numpy()
    np.testing.assert_allclose(got, reference(model.config, gains, power) ** 1.25, rtol=1e-9, atol=0)
    with pytest.raises(ValueError, match="power"):
        model.output_gain(torch.from_numpy(gains)[None])


def test_a_burst_in_noise_is_held_down_and_speech_passes():
    """A low gain that jumps for one frame where the stream is noisy stays at the previous frame's;
    the same jump in a clean stream, and any gain above `rise_limit_gain`, pass unchanged."""
    f, t = 4, 6
    gains = np.full((t, f), 0.01)
    gains[3, 0] = 0.2  # a burst below the threshold
    gains[3, 1] = 0.9  # a speech onset above it
    noisy = rise_limit(CFG, torch.tensor(gains)[None], torch.ones(1, t, f, dtype=torch.float64),
                       torch.zeros(1, f, dtype=torch.float64), torch.zeros(1, 2, dtype=torch.float64))[0][0].numpy()
    assert noisy[3, 0] == pytest.approx(0.01)  # held at the previous frame's gain
    assert noisy[3, 1] == pytest.approx(0.9)
    np.testing.assert_array_equal(noisy[4:], gains[4:])  # the frames after are untouched
    # the stream's running SNR estimate at or above the upper end: nothing changes
    clean_state = torch.tensor([[1.0, 0.0]], dtype=torch.float64)  # all energy kept so far
    steady = rise_limit(CFG, torch.tensor(gains)[None], torch.zeros(1, t, f, dtype=torch.float64),
                        torch.zeros(1, f, dtype=torch.float64), clean_state)[0][0].numpy()
    np.testing.assert_array_equal(steady[1:], gains[1:])


def test_off_by_default_and_stored_only_when_on():
    off = ModelConfig.preset("tim")
    assert off.rise_limit_gain == 0.0
    assert not any(k.startswith("rise_limit") for k in off.to_dict())  # older runtimes read it
    assert [n for n, _ in state_specs(CFG)][-2:] == ["prev_gain", "energy"]
    assert len(state_specs(CFG)) == len(state_specs(off)) + 2
    back = ModelConfig.from_dict(json.loads(json.dumps(CFG.to_dict())))
    assert back == CFG and back.rise_limit_snr_db == (-6.0, 3.0)


@pytest.mark.parametrize("bad", [dict(rise_limit_gain=-0.1), dict(rise_limit_gain=1.5),
                                 dict(rise_limit_snr_db=(3.0, -6.0)), dict(rise_limit_seconds=0.0)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError, match="rise_limit"):
        ModelConfig.preset("tim", **bad)


@pytest.fixture(scope="module")
def limited(torch_model):
    """The random test model with the limit always in full (its gains sit near 0.5, its running
    SNR estimate anywhere) and below a threshold most of its gains are under."""
    model = copy.deepcopy(torch_model)
    model.config = dataclasses.replace(model.config, rise_limit_gain=0.8, rise_limit_snr_db=(60.0, 70.0))
    return model


@pytest.fixture(scope="module")
def limited_rt(limited, tmp_path_factory):
    return runtime_of(limited, tmp_path_factory.mktemp("rise"))


def test_step_graph_matches_torch(limited, torch_model, limited_rt, rng):
    x = speechlike(24000, seed=7)
    offline = limited.enhance(torch.from_numpy(x)[None])[0].numpy()
    assert_differs(offline, torch_model.enhance(torch.from_numpy(x)[None])[0].numpy())  # the limit acts
    assert_close_to_peak(torch_streaming(limited, x), offline)  # the torch step, hop by hop
    assert_close_to_peak(torch_streaming(limited, x, chunks=[5, 1, 17, 200]), offline)  # and in chunks
    assert_close_to_peak(stream_through(limited_rt.stream(), x, random_chunks(len(x), rng)), offline)
    assert_close_to_peak(limited_rt.enhance(x, 16000), offline)


def test_lanes_keep_their_own_state(limited, limited_rt):
    """Two streams batched in one pool, one started later: each gets its own offline output."""
    assert_lanes_match_offline(limited, limited_rt, speechlike(12000, seed=1), speechlike(12000, seed=2) * 0.3)


def test_export_command_sets_the_limit(torch_model, tmp_path, capsys):
    check_export_flag(torch_model, tmp_path, capsys, "--rise-limit", 0.3, 2, "rise_limit_gain")
