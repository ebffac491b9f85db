"""Fixtures for the training tests: a tiny generated corpus in the real layout, and a tiny model."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from tests.conftest import speechlike

TINY_MODEL = {"preset": "tim", "conv_channels": [32, 32, 16, 32], "d_model": 32, "d_ffn": 64, "n_heads": 4,
              "attention_window": 16}


def tone(n: int, sr: int, freqs, seed: int = 0) -> np.ndarray:
    t = np.arange(n) / sr
    r = np.random.default_rng(seed)
    x = sum(np.sin(2 * np.pi * f * t + r.uniform(0, 6.28)) for f in freqs) / len(freqs)
    return (0.3 * x).astype(np.float32)


def write(root: Path, rel: str, x: np.ndarray, sr: int) -> tuple[str, float, int]:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(p), x, sr)
    return rel, len(x) / sr, sr


def make_corpus(root: Path) -> Path:
    """`root/manifests/{speech,noise,music}_{train,valid}.tsv` over generated audio: speech groups
    from three "sources" (one 44.1 kHz stereo, one band-limited to 7 kHz), noises, music."""
    rows = {k: [] for k in ("speech_train", "speech_valid", "noise_train", "noise_valid", "music_train", "music_valid")}
    seed = 0
    for split, groups in (("train", ("libri 11", "libri 12", "libri 13", "g722 en", "kde fr")), ("valid", ("libri 23", "kde nl"))):
        for g in groups:
            src, name = g.split()
            for i in range(3):
                seed += 1
                sr = 44100 if src == "kde" else 16000
                x = speechlike(int(sr * (0.6 + 0.5 * i)), sr, seed=seed)
                if src == "kde":
                    x = np.stack([x, 0.8 * x], axis=1)  # stereo
                rel, sec, _ = write(root, f"speech/{src}/{name}/{i}.{'flac' if src == 'kde' else 'wav'}", x, sr)
                bw = 7000 if src == "g722" else sr / 2
                rows[f"speech_{split}"].append((rel, sec, sr, g, bw))
    r = np.random.default_rng(5)
    for split, n in (("train", 4), ("valid", 2)):
        for i in range(n):
            x = (0.1 * r.standard_normal(int(16000 * (0.7 + 0.4 * i)))).astype(np.float32)
            if i % 2:
                x = np.cumsum(x) / 30.0  # a brown-ish noise
                x = (x - x.mean()).astype(np.float32)
            rel, sec, sr = write(root, f"noise/src{i % 2}/{split}{i}.wav", x, 16000)
            rows[f"noise_{split}"].append((rel, sec, sr, f"src{i % 2}", 8000))
        x = tone(int(22050 * 1.5), 22050, (220, 277, 330), seed=i)
        rel, sec, sr = write(root, f"music/m/{split}.ogg", x, 22050)
        rows[f"music_{split}"].append((rel, sec, sr, "m", 11025))
    (root / "manifests").mkdir(parents=True, exist_ok=True)
    for name, rs in rows.items():
        with open(root / "manifests" / f"{name}.tsv", "w") as f:
            f.write("path\tseconds\tsample_rate\tgroup\tbandwidth_hz\n")
            for rel, sec, sr, g, bw in rs:
                f.write(f"{rel}\t{sec:.3f}\t{sr}\t{g}\t{bw:g}\n")
    return root


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def tiny_config(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("cfg") / "tiny.json"
    p.write_text(json.dumps(TINY_MODEL))
    return p


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("audio-cache")


@pytest.fixture(scope="session")
def tiny_model():
    """A tiny `tim` model (8 blocks, 5 TIM layers, random weights, non-trivial normalisation), eval mode."""
    import torch

    from enhancer import ModelConfig, build_model

    torch.manual_seed(0)
    cfg = ModelConfig.preset("tim", **{k: tuple(v) if isinstance(v, list) else v for k, v in TINY_MODEL.items() if k != "preset"})
    model = build_model(cfg).eval()
    g = torch.Generator().manual_seed(1)
    model.set_normalization(torch.randn(cfg.n_freqs, generator=g) * 0.5 - 4.0, torch.rand(cfg.n_freqs, generator=g) + 1.0)
    return model


@pytest.fixture(scope="session")
def tiny_onnx(tiny_model, tmp_path_factory) -> Path:
    from enhancer.build.export import export_step

    path = tmp_path_factory.mktemp("tiny-onnx") / "tiny.onnx"
    export_step(tiny_model, path, check=False)
    return path


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_model, tmp_path_factory) -> Path:
    from enhancer import save_checkpoint

    return save_checkpoint(tiny_model, tiny_model.config, tmp_path_factory.mktemp("tiny-ckpt") / "tiny.pt")
