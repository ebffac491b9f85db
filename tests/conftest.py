"""Shared fixtures: small models exported once per test session (random weights, fixed seed)."""
from __future__ import annotations

import numpy as np
import pytest

SHORT_WINDOW = 16  # attention window (frames) of the test models: test inputs are longer than it


@pytest.fixture(scope="session")
def torch_model():
    """A `tim` model with a short attention window and non-trivial normalisation, in eval mode."""
    import torch

    import enhancer

    torch.manual_seed(0)
    cfg = enhancer.ModelConfig.preset("tim", attention_window=SHORT_WINDOW)
    model = enhancer.build_model(cfg).eval()
    g = torch.Generator().manual_seed(1)
    model.set_normalization(torch.randn(cfg.n_freqs, generator=g) * 0.5 - 4.0, torch.rand(cfg.n_freqs, generator=g) + 1.0)
    return model


def export_checked(model, path):
    """`model` exported to ONNX at `path` (the step graph the runtime and server load), checked:
    onnx.checker, then onnxruntime against torch step by step with lanes at different positions."""
    from enhancer.build.export import MAX_REL_DIFF, export_step

    report = export_step(model, path, check=True)
    assert report["max_rel_diff"] <= MAX_REL_DIFF, report
    return path


def runtime_of(model, folder):
    """`model` exported and checked (`export_checked`) into `folder`, loaded on the CPU."""
    from enhancer.runtime import Enhancer

    return Enhancer.from_pretrained(export_checked(model, folder / "model.onnx"), providers=["CPUExecutionProvider"])


def assert_lanes_match_offline(model, runtime, a, b, late: int = 10):
    """Streams `a` and `b` batched in one pool of `runtime`, `b` starting `late` hops after `a`:
    each gets the offline torch output of `model` (what a post-filter's per-stream state must keep)."""
    import torch

    from enhancer.runtime import LanePool
    from tests.tolerance import assert_close_to_peak

    hop = model.config.stft.hop
    pool = LanePool(runtime.engine, 2)
    lanes, no_limit = pool.alloc(2), np.zeros(2, np.float32)
    outs = [[], []]
    for k in range(len(a) // hop + late):
        if k < late:
            outs[0].append(pool.step(lanes[:1], a[None, k * hop:(k + 1) * hop], no_limit[:1]).out[0])
            continue
        j = k - late
        h = np.stack([a[k * hop:(k + 1) * hop] if k < len(a) // hop else np.zeros(hop, np.float32),
                      b[j * hop:(j + 1) * hop]])
        r = pool.step(lanes, h, no_limit)
        outs[0].append(r.out[0])
        outs[1].append(r.out[1])
    d = model.config.delay_samples
    for x, out in zip((a, b), outs):
        n = len(x) // hop * hop - d
        y = np.concatenate(out)[d:d + n]
        assert_close_to_peak(y, model.enhance(torch.from_numpy(x)[None])[0].numpy()[:n])


def check_export_flag(model, tmp_path, capsys, flag: str, good: float, bad: float, field: str):
    """`enhancer export CKPT FLAG good` writes a checked graph and a checkpoint with `field` = good;
    `FLAG bad` is refused with an error that names `field`."""
    import json

    from enhancer.build.checkpoint import load_checkpoint, save_checkpoint
    from enhancer.build.export import MAX_REL_DIFF
    from enhancer.cli import main as cli_main
    from enhancer.runtime import Enhancer

    pt = save_checkpoint(model, model.config, tmp_path / "m.pt")
    out = tmp_path / "m.onnx"
    assert cli_main(["export", str(pt), "-o", str(out), flag, str(good), "-q",
                     "--save-checkpoint", str(tmp_path / "saved.pt")]) == 0
    assert json.loads(capsys.readouterr().out)["max_rel_diff"] <= MAX_REL_DIFF
    assert getattr(Enhancer.from_pretrained(out, providers=["CPUExecutionProvider"]).config, field) == good
    assert getattr(load_checkpoint(tmp_path / "saved.pt").config, field) == good
    assert cli_main(["export", str(pt), "-o", str(out), flag, str(bad), "-q"]) != 0
    assert field in capsys.readouterr().err


@pytest.fixture(scope="session")
def model_path(torch_model, tmp_path_factory):
    """`torch_model` exported and checked (`export_checked`)."""
    return export_checked(torch_model, tmp_path_factory.mktemp("model") / "tim-test.onnx")


@pytest.fixture(scope="session")
def enhancer_rt(model_path):
    from enhancer.runtime import Enhancer

    return Enhancer.from_pretrained(model_path, providers=["CPUExecutionProvider"])


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def speechlike(n: int, sr: int = 16000, seed: int = 0, channels: int = 0) -> np.ndarray:
    """Deterministic harmonic bursts plus noise: audio with structure for round-trip tests."""
    r = np.random.default_rng(seed)
    t = np.arange(n) / sr
    f0 = 120 + 40 * np.sin(2 * np.pi * 0.7 * t)
    voiced = sum(np.sin(2 * np.pi * k * np.cumsum(f0) / sr) / k for k in range(1, 8))
    env = (np.sin(2 * np.pi * 2.0 * t) > -0.2).astype(np.float64)
    x = 0.2 * voiced * env + 0.02 * r.standard_normal(n)
    x = x.astype(np.float32)
    if channels:
        x = np.stack([np.roll(x, 37 * c) * (1.0 - 0.2 * c) for c in range(channels)], axis=1)
    return x


def broken_audio() -> dict[str, bytes]:
    """Broken audio files (name -> bytes): truncated, not audio, NaN samples, a header alone, empty."""
    import io

    import soundfile as sf

    good = io.BytesIO()
    sf.write(good, speechlike(16000), 16000, format="WAV", subtype="PCM_16")
    nan = io.BytesIO()
    x = speechlike(4000)
    x[100] = np.nan
    sf.write(nan, x, 16000, format="WAV", subtype="FLOAT")
    return {"truncated.wav": good.getvalue()[:20000], "junk.wav": b"hello, this is not audio" * 20,
            "nan.wav": nan.getvalue(), "header.wav": good.getvalue()[:30], "empty.wav": b""}


def core_message(data: bytes) -> str:
    """What the core's reader says of these bytes (the service answers with the same words)."""
    import io

    from enhancer.audio_io import AudioReader
    from enhancer.errors import AudioError

    with pytest.raises(AudioError) as e, AudioReader(io.BytesIO(data)) as r:
        while r.read(16000) is not None:
            pass
    return str(e.value)
