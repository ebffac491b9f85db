"""`fit --vb-root`: Voicebank+DEMAND's training set on a tiny generated layout with the real folder
and file names. Clean speech goes in as speech, noisy minus clean as noise; the test set and the
evaluation speakers never reach training."""
from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf

from tests.conftest import speechlike
from training.data import layouts
from training.data.audio_cache import read16k
from training.data.manifests import DataError

SPEAKERS = ("p226", "p227", "p228", "p230", "p231", "p233", "p236", "p239")


def make_vb(root, speakers=SPEAKERS, test_speakers=("p232", "p257")):
    rng = np.random.default_rng(0)
    noises = {}
    for kind, spks in (("trainset_28spk", speakers), ("testset", test_speakers)):
        (root / f"clean_{kind}_wav").mkdir(parents=True)
        (root / f"noisy_{kind}_wav").mkdir(parents=True)
        for i, spk in enumerate(spks):
            for utt in (1, 2):
                name = f"{spk}_{utt:03d}.wav"
                clean = speechlike(8000, seed=10 * i + utt) * 0.3
                noise = (0.02 * rng.standard_normal(8000)).astype(np.float32)
                sf.write(str(root / f"clean_{kind}_wav" / name), clean, 16000, subtype="FLOAT")
                sf.write(str(root / f"noisy_{kind}_wav" / name), clean + noise, 16000, subtype="FLOAT")
                noises[name] = noise
    return noises


def test_clean_is_speech_and_noisy_minus_clean_is_noise(tmp_path):
    noises = make_vb(tmp_path / "vb")
    logs = []
    data = layouts.vb_layout(tmp_path / "vb", noise_dir=tmp_path / "noise", log=logs.append)
    speech = data.train["speech"] + data.valid["speech"]
    noise = data.train["noise"] + data.valid["noise"]
    assert data.valid["speech"] and data.train["speech"] and data.valid["noise"]
    spk = {it.group.split()[1] for it in speech}
    assert spk == set(SPEAKERS) - {"p228"}  # p228: evaluated on in this project
    assert not spk & {"p232", "p257"} and all("testset" not in it.path for it in speech + noise)
    # a speaker's speech and its pairs' noise are on the same side of the split
    assert {it.group.split()[1] for it in data.valid["speech"]} == {it.group.split()[1] for it in data.valid["noise"]}
    assert len(noise) == len(speech)
    for it in noise:
        name = it.path.rsplit("/", 1)[1].replace(".flac", ".wav")
        want = noises[name]  # written as 24-bit FLAC: a step of 2**-23, far below 1e-5 of this noise's peak
        np.testing.assert_allclose(read16k(it.path), want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert any("testset" in m for m in logs) and any("p228" in m for m in logs)
    again = layouts.vb_layout(tmp_path / "vb", noise_dir=tmp_path / "noise", log=logs.append)  # written once
    assert not any("derived" in m for m in logs[-2:]) and again.train["noise"] == data.train["noise"]


def test_the_test_set_is_refused(tmp_path):
    make_vb(tmp_path / "vb")
    with pytest.raises(DataError, match="test set"):
        layouts.vb_layout(tmp_path / "vb" / "clean_testset_wav", noise_dir=tmp_path / "noise")
    only_test = tmp_path / "only"
    make_vb(only_test, speakers=())
    for d in only_test.glob("*trainset*"):
        d.rmdir()
    with pytest.raises(DataError, match="never used for training"):
        layouts.vb_layout(only_test, noise_dir=tmp_path / "noise")
    leaked = tmp_path / "leaked"
    make_vb(leaked, speakers=("p226", "p257"))
    with pytest.raises(DataError, match="p257 belongs to the Voicebank\\+DEMAND test set"):
        layouts.vb_layout(leaked, noise_dir=tmp_path / "noise")


def test_fit_takes_vb_root_as_its_one_data_source(tmp_path, capsys):
    from training.cli import main

    make_vb(tmp_path / "vb")
    assert main(["fit", "--vb-root", str(tmp_path / "vb"), "--data", str(tmp_path), "--out", str(tmp_path / "r")]) == 2
    assert "--vb-root DIR" in capsys.readouterr().err
