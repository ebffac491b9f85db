"""The gain exponent (`ModelConfig.gain_exponent`): the same in the offline torch reference, the
exported step graph (live and in chunks) and the runtime; the speech activity is the network's."""
import copy
import dataclasses

import numpy as np
import pytest
import torch

from enhancer import ModelConfig
from enhancer.runtime import LanePool, min_gain_for
from tests.conftest import check_export_flag, runtime_of, speechlike
from tests.enhancer.test_streaming import random_chunks, stream_through, torch_streaming
from tests.tolerance import assert_close_to_peak, assert_differs

EXPONENT = 1.5


@pytest.fixture(scope="module")
def sharper(torch_model):
    model = copy.deepcopy(torch_model)
    model.config = dataclasses.replace(model.config, gain_exponent=EXPONENT)
    return model


@pytest.fixture(scope="module")
def sharper_rt(sharper, tmp_path_factory):
    return runtime_of(sharper, tmp_path_factory.mktemp("exponent"))


def test_output_gain_is_the_power_of_the_network_gain(sharper, torch_model):
    g = torch.linspace(0.0, 1.0, 11)
    assert torch.equal(torch_model.output_gain(g), g)  # 1: as it is
    assert torch.allclose(sharper.output_gain(g), g ** EXPONENT)
    assert sharper.output_gain(torch.ones(1)).item() == 1.0  # a gain of one stays one


@pytest.mark.parametrize("bad", [0.0, 0.4, 4.5, -1.0])
def test_exponent_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="gain_exponent"):
        ModelConfig.preset("tim", gain_exponent=bad)


def test_config_round_trip_and_old_configs_default_to_one():
    cfg = ModelConfig.preset("tim", gain_exponent=1.25)
    assert ModelConfig.from_dict(cfg.to_dict()).gain_exponent == 1.25
    old = cfg.to_dict()
    del old["gain_exponent"]  # written before the field existed
    assert ModelConfig.from_dict(old).gain_exponent == 1.0


def test_step_graph_matches_torch_with_an_exponent(sharper, torch_model, sharper_rt, rng):
    x = speechlike(24000, seed=7)
    offline = sharper.enhance(torch.from_numpy(x)[None])[0].numpy()
    assert_differs(offline, torch_model.enhance(torch.from_numpy(x)[None])[0].numpy())  # the exponent acts
    assert_close_to_peak(torch_streaming(sharper, x), offline)  # the torch step, hop by hop
    assert_close_to_peak(torch_streaming(sharper, x, chunks=[5, 1, 17]), offline)  # and in chunks
    assert_close_to_peak(stream_through(sharper_rt.stream(), x, random_chunks(len(x), rng)), offline)
    assert_close_to_peak(sharper_rt.enhance(x, 16000), offline)


def test_attenuation_limit_applies_after_the_exponent(sharper, sharper_rt):
    x = speechlike(8000, seed=3)
    ref = sharper.enhance(torch.from_numpy(x)[None], min_gain=min_gain_for(12.0))[0].numpy()
    assert_close_to_peak(sharper_rt.enhance(x, 16000, atten_lim_db=12.0), ref)


def test_speech_activity_is_the_network_gain_not_the_output_gain(enhancer_rt, sharper_rt):
    """The full-band gate reads the activity: the exponent must not move it."""
    x = speechlike(16000, seed=4)
    pool_a, pool_b = LanePool(enhancer_rt.engine, 1), LanePool(sharper_rt.engine, 1)
    hop = enhancer_rt.config.stft.hop
    lanes, no_limit = pool_a.alloc(1), np.zeros(1, np.float32)
    pool_b.alloc(1)
    moved = 0.0
    for k in range(len(x) // hop):
        h = x[None, k * hop:(k + 1) * hop]
        ra, rb = pool_a.step(lanes, h, no_limit), pool_b.step(lanes, h, no_limit)
        np.testing.assert_allclose(rb.activity, ra.activity, rtol=1e-5, atol=0)
        moved = max(moved, float(np.abs(rb.out - ra.out).max()))
    assert moved > 1e-3 * float(np.abs(x).max())  # while the output does change


def test_export_command_sets_the_exponent(torch_model, tmp_path, capsys):
    check_export_flag(torch_model, tmp_path, capsys, "--gain-exponent", 1.25, 9, "gain_exponent")
