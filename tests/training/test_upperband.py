"""`training.upperband`: the head's training recipe. On mixtures whose clean share of each band is a
function of one feature, the trained head removes more noise under speech than passing the band
through, its exported weights load in the runtime's `UpperHead` and give the gains torch gave; the
collected features are the runtime's own (a recorder head sees what `BandGains` hands a head), and
the targets use the upper band's framing (the clean plus the noise per band is the noisy band)."""
import numpy as np
import pytest

from enhancer.upperhead import N_FEATURES, UpperHead
from training import upperband as ub

torch = pytest.importorskip("torch")


def synthetic(n: int, seed: int) -> list[dict]:
    r = np.random.default_rng(seed)
    items = []
    for _ in range(n):
        x = r.normal(0, 1, (3, 60, N_FEATURES)).astype(np.float32)
        share = 1 / (1 + np.exp(-3 * x[..., 0]))  # the clean's share of each band and frame
        total = r.exponential(1.0, (3, 60))
        items.append({"X": x, "S": share * total, "N": (1 - share) * total, "speech": np.ones(60, bool)})
    return items


def test_training_learns_the_gain_and_exports_weights_the_runtime_reads():
    train, held = synthetic(48, 0), synthetic(8, 1)
    passthrough = ub.score([np.ones_like(it["S"]) for it in held], held)[0]
    ideal = ub.score([it["S"] / (it["S"] + it["N"]) for it in held], held)[0]
    weights = ub.train(train, held, hidden=8, epochs=12, lr=1e-2, batch=8, log=lambda m: None)
    head = UpperHead(weights)
    gains = []
    for it in held:
        h, g = head.state((3,)), []
        for t in range(it["X"].shape[1]):
            gt, h = head.step(it["X"][:, t], h)
            g.append(gt)
        gains.append(np.stack(g, 1))
    removed = ub.score(gains, held)[0]
    assert passthrough == pytest.approx(0.0, abs=1e-9)
    assert removed > 0.5 * ideal, (removed, ideal)


def test_the_collected_features_and_targets_follow_the_runtime(enhancer_rt):
    from enhancer.fullband import BandGains, HighBand

    sr = 48000
    r = np.random.default_rng(3)
    clean = (0.05 * np.sin(2 * np.pi * 440 * np.arange(sr) / sr) * (np.arange(sr) % 9600 < 4800)).astype(np.float32)
    noise = (0.01 * r.standard_normal(sr)).astype(np.float32)
    rec = ub._Recorder()
    engine = enhancer_rt.engine
    kept = engine.upper_head
    try:
        engine.upper_head = rec
        enhancer_rt.enhance(clean + noise, sr)
    finally:
        engine.upper_head = kept
    band = HighBand(enhancer_rt.config, sr, 1)
    gains = BandGains(sr, 2 * band.fhop, band.fhop, 1)
    frames = len(rec.frames)
    assert frames == pytest.approx(sr / band.fhop, abs=3)
    assert rec.frames[0].shape == (gains.k, N_FEATURES)
    S, N, CL = ub.frame_targets(clean, noise, sr, frames, band.fhop, gains._member)
    noisy = ub.frame_targets(clean + noise, np.zeros_like(noise), sr, frames, band.fhop, gains._member)[0]
    cross = np.abs(noisy - S - N).sum() / (S + N).sum()
    assert S.shape == N.shape == (frames, gains.k) and CL.shape == (frames,)
    assert cross < 0.05  # uncorrelated clean and noise: their band powers add up to the noisy's


def test_the_command_trains_on_collected_frames_from_a_head_and_records_its_arguments(tmp_path):
    """`--frames` (repeatable) and `--init`: the head is trained on those frames from those weights,
    written beside train.json, which records the arguments (paths as text)."""
    import json

    from tests.enhancer.test_upperhead import random_weights

    arrays = {}
    for i, it in enumerate(synthetic(6, 2)):
        cl = np.full(it["X"].shape[1], 1.0)
        arrays.update({f"m{i:04d}_X": np.transpose(it["X"], (1, 0, 2)), f"m{i:04d}_S": it["S"].T,
                       f"m{i:04d}_N": it["N"].T, f"m{i:04d}_CL": cl, f"m{i:04d}_sr": np.array(48000)})
    np.savez(tmp_path / "frames.npz", **arrays)
    np.savez(tmp_path / "init.npz", **random_weights(hidden=8, seed=4))
    out = tmp_path / "run"
    assert ub.main(["--out", str(out), "--frames", str(tmp_path / "frames.npz"), "--frames", str(tmp_path / "frames.npz"),
                    "--init", str(tmp_path / "init.npz"), "--hidden", "8", "--epochs", "1", "--held-out", "2"]) == 0
    record = json.loads((out / "train.json").read_text())
    assert record["frames"] == [str(tmp_path / "frames.npz")] * 2 and record["init"] == str(tmp_path / "init.npz")
    trained = UpperHead.load(out / "upperband.npz")
    assert trained.hidden == 8
    assert not np.array_equal(trained.inp_w, UpperHead(random_weights(hidden=8, seed=4)).inp_w)


def test_collect_records_the_runtimes_inputs_beside_a_head_for_other_inputs(tmp_path):
    """A collection runs the model without its head (a recorder takes its place): a head trained
    for other inputs beside the model, which the runtime refuses, does not stop it."""
    from enhancer.errors import CheckpointError
    from enhancer.runtime import Enhancer, default_model_path
    from tests.enhancer.test_upperhead import random_weights
    from tests.training.conftest import make_corpus, write

    data = make_corpus(tmp_path / "corpus")  # its one full-band voice: kde fr at 44.1 kHz
    hiss = np.random.default_rng(0).normal(0, 0.05, 2 * 44100).astype(np.float32)
    rel, sec, sr = write(data, "noise/air/hiss.flac", hiss, 44100)
    with open(data / "manifests" / "noise_train.tsv", "a") as f:
        f.write(f"{rel}\t{sec:.3f}\t{sr}\tair\t22050\n")
    model = tmp_path / "m" / "tim.onnx"
    model.parent.mkdir()
    model.symlink_to(default_model_path().resolve())
    np.savez(model.parent / "upperband.npz", **random_weights(n_in=N_FEATURES - 3))
    with pytest.raises(CheckpointError, match="inputs"):
        Enhancer.from_pretrained(model, providers=["CPUExecutionProvider"])

    items = ub.load_frames(ub.collect(data, 2, 0, tmp_path / "frames.npz", model, log=lambda m: None))
    assert len(items) == 2
    for it in items:
        k, frames, width = it["X"].shape
        assert width == N_FEATURES and it["S"].shape == it["N"].shape == (k, frames) and it["speech"].any()
    with pytest.raises(CheckpointError, match="nowhere.onnx"):
        ub.collect(data, 1, 0, tmp_path / "none.npz", tmp_path / "nowhere.onnx", log=lambda m: None)
