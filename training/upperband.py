"""Train the upper band's learned head (`enhancer.upperhead`; an upperband.npz beside a model).

    python -m training.upperband --out runs/upperband                  # collect, train, export
    python -m training.upperband --out runs/upperband --data CORPUS --mixtures 800 --epochs 20

In steps (the head measured in docs/training-log.md): 800 mixtures, 20 epochs; then 300 more whose
noise is only above 8.2-9.5 kHz (`--highpass-share 1`, collected into a second folder), and 8
epochs on both from the first head's weights at a third of the learning rate:

    python -m training.upperband --out runs/ub1
    python -m training.upperband --out runs/ub2 --seed 21 --mixtures 300 --highpass-share 1 --epochs 0
    python -m training.upperband --out runs/ub3 --frames runs/ub1/frames.npz --frames runs/ub2/frames.npz \
        --init runs/ub1/upperband.npz --epochs 8 --lr 1e-3

The step graph stays frozen; the head learns one gain per upper band and 10 ms frame.

1. **Collect.** Full-band mixtures of the corpus's *training* rows (speech at >= 44.1 kHz whose
   bandwidth is above 16 kHz, strung into 4-8 s utterances at -35..-18 dB; noise whose recording
   has at least 5 % of its energy above 8 kHz, at -5..25 dB SNR), each at 44.1 or 48 kHz. Each
   runs through the runtime as a stream would (`Enhancer.enhance`, `band="full"`) with a head that
   records what it is given, so the features are the runtime's own, frame for frame; beside them,
   the clean speech's and the noise's power per band over the same windows (the targets), and the
   clean's full-band power (which frames are speech). Written to `frames.npz`.
2. **Train** (torch, CPU): a linear layer, a GRU and a sigmoid per band (weights shared across
   bands), on whole mixtures, minimising the error energy a gain leaves, alpha (g - 1)^2 S + g^2 N,
   summed over frames and bands and divided by the mixture's noise energy, plus `lsd_weight` times
   the mean square log-ratio of the output's band power to the clean's in speech frames (floored
   at 1e-4 of the clean's mean); Adam with a cosine schedule to zero; the last epoch is kept. Every
   epoch is scored on held-out mixtures (the noise removed under speech, the level in speech).
3. **Export** `upperband.npz` (float32 arrays, no pickle) for `enhancer.upperhead.UpperHead`.

The evaluation sets (`training.peers.fullband`) use the corpus's *valid* rows only.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import soxr

from training.data import fullband as fb

RATE = fb.RATE
SNR_DB = (-5.0, 25.0)
SPEECH_LEVEL_DB = (-35.0, -18.0)
RATES = (44100, 48000)


# ---------------------------------------------------------------------- collect
def mixtures(data: Path, n: int, seed: int, highpass_share: float = 0.0):
    """Yield n (clean, noise, rate) full-band training mixtures (float32, at `rate`); in a share
    `highpass_share` of them the noise is kept only above 8.2-9.5 kHz (a hiss over a low band that
    is silent in pauses)."""
    rng = np.random.default_rng(seed)
    speech = [r for r in fb.rows(data, "speech_train.tsv")
              if int(r["sample_rate"]) >= 44100 and float(r["bandwidth_hz"]) > 16000]
    noise = [r for r in fb.rows(data, "noise_train.tsv")
             if int(r["sample_rate"]) >= 44100 and float(r["bandwidth_hz"]) > 16000 and float(r["seconds"]) >= 1.0]
    loaded = {}
    for r in noise:
        x = fb.load(data, r["path"])
        if np.sqrt(np.mean(x ** 2)) >= 1e-4 and fb.upper_share(x) >= fb.NOISE_UPPER_SHARE:
            loaded[r["path"]] = x
    noises = sorted(loaded)
    voices: dict[str, list[dict]] = {}
    for r in speech:
        voices.setdefault(r["group"], []).append(r)
    names = sorted(voices)
    if not noises or not names:
        raise RuntimeError(f"{data}: no full-band training speech or noise")
    made = 0
    while made < n:
        voice = names[int(rng.integers(len(names)))]
        target = rng.uniform(6.0, 8.0)
        parts, total = [np.zeros(int(rng.uniform(0.3, 0.6) * RATE), np.float32)], 0.0
        for j in rng.permutation(len(voices[voice]))[:40]:
            c = fb.trim(fb.load(data, voices[voice][j]["path"]))
            if fb.upper_share(c) < 1e-4:
                continue
            c = c / (np.sqrt(np.mean(c ** 2)) + 1e-9) * 10 ** (rng.uniform(*SPEECH_LEVEL_DB) / 20)
            parts += [c, np.zeros(int(rng.uniform(0.3, 0.9) * RATE), np.float32)]
            total = sum(len(p) for p in parts) / RATE
            if total >= target:
                break
        if total < 4.0:
            continue
        clean = np.concatenate(parts)[:int(8.0 * RATE)]
        nz, used = [], 0
        while used < len(clean):
            x = loaded[noises[int(rng.integers(len(noises)))]]
            nz.append(x)
            used += len(x)
        noise_ = np.concatenate(nz)[:len(clean)]
        if rng.random() < highpass_share:
            spec = np.fft.rfft(noise_)
            spec[np.fft.rfftfreq(len(noise_), 1 / RATE) < rng.uniform(8200.0, 9500.0)] = 0
            noise_ = np.fft.irfft(spec, len(noise_)).astype(np.float32)
        snr = rng.uniform(*SNR_DB)
        noise_ = noise_ * np.sqrt(np.mean(clean ** 2) / (np.mean(noise_ ** 2) + 1e-20)) * 10 ** (-snr / 20)
        peak = np.abs(clean + noise_).max()
        if peak > 0.99:
            clean, noise_ = clean * 0.99 / peak, noise_ * 0.99 / peak
        sr = RATES[int(rng.integers(len(RATES)))]
        if sr != RATE:
            clean, noise_ = (soxr.resample(v, RATE, sr, quality="VHQ").astype(np.float32) for v in (clean, noise_))
        made += 1
        yield clean.astype(np.float32), noise_.astype(np.float32), sr


class _Recorder:
    """A head that keeps the features it is given (and gives gain 1, which nothing reads)."""

    def __init__(self):
        self.hidden, self.frames = 1, []

    def state(self, shape):
        return np.zeros(shape + (1,), np.float32)

    def step(self, x, h):
        self.frames.append(x[0].copy())
        return np.ones(x.shape[:-1]), h


def frame_targets(clean: np.ndarray, noise: np.ndarray, sr: int, frames: int, fhop: int, member: np.ndarray):
    """Per frame of the upper band's framing: the clean's and the noise's mean power per band
    (frames, K) and the clean's full-band power (frames,)."""
    from enhancer.fullband import _sqrt_hann, _window_at

    w = _sqrt_hann(2 * fhop)
    S, N, CL = [], [], []
    for f in range(frames):
        start = (f - 1) * fhop
        pc = np.abs(np.fft.rfft(_window_at(clean[:, None], 0, start, 2 * fhop)[:, 0] * w)) ** 2
        pn = np.abs(np.fft.rfft(_window_at(noise[:, None], 0, start, 2 * fhop)[:, 0] * w)) ** 2
        S.append(member @ pc)
        N.append(member @ pn)
        CL.append(pc.sum())
    return np.array(S, np.float32), np.array(N, np.float32), np.array(CL, np.float32)


def collect(data: Path, n: int, seed: int, out: Path, model: Path | None = None, highpass_share: float = 0.0,
            log=print) -> Path:
    """Write `out` (npz): per mixture m, `m_X` (frames, K, F) features, `m_S`, `m_N` (frames, K),
    `m_CL` (frames,), `m_sr`. The model's own head is not read (a recorder takes its place), so a
    head trained for other inputs does not stop a collection."""
    import tempfile

    from enhancer.errors import CheckpointError
    from enhancer.fullband import HighBand
    from enhancer.runtime import Enhancer, default_model_path

    model = Path(model) if model is not None else default_model_path()
    if not model.is_file():  # named here: the session below opens a link to it
        raise CheckpointError(f"no model at {model}")
    with tempfile.TemporaryDirectory() as tmp:  # the model alone, without the head beside it
        bare = Path(tmp) / "model.onnx"
        bare.symlink_to(model.resolve())
        enh = Enhancer.from_pretrained(bare, providers=["CPUExecutionProvider"])
    arrays, t0 = {}, time.time()
    for i, (clean, noise, sr) in enumerate(mixtures(data, n, seed, highpass_share)):
        rec = _Recorder()
        enh.engine.upper_head = rec
        enh.enhance(clean + noise, sr)
        band = HighBand(enh.config, sr, 1)  # its framing and band matrix: the runtime's
        X = np.stack(rec.frames)
        S, N, CL = frame_targets(clean, noise, sr, len(X), band.fhop, band._gains._member)
        key = f"m{i:04d}"
        arrays.update({f"{key}_X": X, f"{key}_S": S, f"{key}_N": N, f"{key}_CL": CL, f"{key}_sr": np.array(sr)})
        if (i + 1) % 50 == 0:
            log(f"collected {i + 1}/{n} mixtures in {time.time() - t0:.0f} s")
    np.savez(out, **arrays)
    return out


# ---------------------------------------------------------------------- train
def load_frames(path: Path) -> list[dict]:
    with np.load(path) as z:
        keys = sorted({k.rsplit("_", 1)[0] for k in z.files})
        items = []
        for k in keys:
            S, N, CL = (z[f"{k}_{s}"].astype(np.float64) for s in ("S", "N", "CL"))
            level, loud = fb.frame_levels(CL)
            speech = level >= loud + fb.SPEECH_DB
            items.append({"X": np.transpose(z[f"{k}_X"], (1, 0, 2)), "S": S.T, "N": N.T, "speech": speech})
    return items


def score(gains: list[np.ndarray], items: list[dict]) -> tuple[float, float]:
    """(noise removed under speech, level in speech vs the clean), dB, mean over mixtures, on the
    band energies."""
    removed, level = [], []
    for g, it in zip(gains, items):
        S, N, sp = it["S"], it["N"], it["speech"]
        err = (g - 1) ** 2 * S + g ** 2 * N
        removed.append(10 * np.log10(N[:, sp].sum() / max(err[:, sp].sum(), 1e-30)))
        level.append(10 * np.log10((g ** 2 * (S + N))[:, sp].sum() / max(S[:, sp].sum(), 1e-30)))
    return float(np.mean(removed)), float(np.mean(level))


def train(items: list[dict], held: list[dict], hidden: int = 48, epochs: int = 20, alpha: float = 1.6,
          lsd_weight: float = 0.2, lr: float = 3e-3, batch: int = 16, seed: int = 0, init: dict | None = None,
          log=print) -> dict:
    """Train the head (from `init`, `UpperHead` arrays, when given); returns the last epoch's
    weights as `UpperHead` arrays."""
    import torch

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    n_features = items[0]["X"].shape[-1]

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(n_features, hidden)
            self.gru = torch.nn.GRU(hidden, hidden, batch_first=True)
            self.out = torch.nn.Linear(hidden, 1)

        def forward(self, x):
            h, _ = self.gru(torch.relu(self.inp(x)))
            return torch.sigmoid(self.out(h))[..., 0]

    names = {"inp_w": "inp.weight", "inp_b": "inp.bias", "w_ih": "gru.weight_ih_l0", "w_hh": "gru.weight_hh_l0",
             "b_ih": "gru.bias_ih_l0", "b_hh": "gru.bias_hh_l0", "out_w": "out.weight", "out_b": "out.bias"}
    net = Head()
    if init is not None:
        net.load_state_dict({v: torch.tensor(np.asarray(init[k], np.float32)) for k, v in names.items()})
    opt = torch.optim.Adam(net.parameters(), lr)

    def stack(group):
        t = max(it["X"].shape[1] for it in group)
        pad = lambda a: np.pad(a, [(0, 0), (0, t - a.shape[1])] + [(0, 0)] * (a.ndim - 2))  # noqa: E731
        f32 = lambda a: torch.tensor(np.concatenate(a), dtype=torch.float32)  # noqa: E731
        k = [it["X"].shape[0] for it in group]
        return (torch.tensor(np.concatenate([pad(it["X"]) for it in group])),
                f32([pad(it["S"]) for it in group]), f32([pad(it["N"]) for it in group]),
                f32([np.full((kk, 1), it["N"].sum()) for kk, it in zip(k, group)]),
                f32([np.repeat(pad(it["speech"][None].astype(np.float64)), kk, 0) for kk, it in zip(k, group)]),
                f32([np.full((kk, 1), 1e-4 * it["S"][:, it["speech"]].mean()) for kk, it in zip(k, group)]))

    def gains(group):
        with torch.no_grad():
            return [net(torch.tensor(it["X"])).numpy().astype(np.float64) for it in group]

    for epoch in range(epochs):
        order = rng.permutation(len(items))
        for b in range(0, len(items), batch):
            x, s, n, total, speech, floor = stack([items[i] for i in order[b:b + batch]])
            g = net(x)
            loss = ((alpha * (g - 1) ** 2 * s + g ** 2 * n) / total).sum() / len(order[b:b + batch])
            if lsd_weight > 0:
                d = torch.log10((g ** 2 * (s + n) + floor) / (s + floor))
                loss = loss + lsd_weight * (d ** 2 * speech).sum() / speech.sum().clamp(min=1.0)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
        for group in opt.param_groups:
            group["lr"] = lr * 0.5 * (1 + np.cos(np.pi * (epoch + 1) / epochs))
        removed, level = score(gains(held), held)
        log(f"epoch {epoch}: held-out noise removed under speech {removed:.2f} dB, level {level:+.2f} dB")
    kept = net.state_dict()
    return {k: kept[v].numpy().astype(np.float32) for k, v in names.items()}


# ---------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    from training.defaults import Defaults

    p = argparse.ArgumentParser(prog="python -m training.upperband", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for frames.npz, upperband.npz and train.json")
    p.add_argument("--data", type=Path, default=Defaults.beside_checkout().corpus,
                   help="corpus root with manifests/ (default: ../enhancer-data beside the checkout)")
    p.add_argument("--model", type=Path, default=None, help="step graph (default: the shipped model)")
    p.add_argument("--mixtures", type=int, default=800, help="training mixtures to collect (default 800)")
    p.add_argument("--held-out", type=int, default=40, help="of those, kept out of training to score epochs")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--hidden", type=int, default=48)
    p.add_argument("--alpha", type=float, default=1.6, help="weight of the speech distortion term (default 1.6)")
    p.add_argument("--lsd-weight", type=float, default=0.2, help="weight of the log-spectral term (default 0.2)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--highpass-share", type=float, default=0.0,
                   help="share of mixtures whose noise is kept only above 8.2-9.5 kHz (default 0)")
    p.add_argument("--frames", type=Path, action="append", default=None,
                   help="train on these collected frames.npz (repeatable) instead of collecting into --out")
    p.add_argument("--init", type=Path, default=None, help="start from these head weights (an upperband.npz)")
    p.add_argument("--seed", type=int, default=12)
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    sources = a.frames
    if not sources:
        sources = [a.out / "frames.npz"]
        if not sources[0].exists():
            collect(a.data, a.mixtures, a.seed, sources[0], a.model, a.highpass_share, log)
    items = [it for f in sources for it in load_frames(f)]
    held, rest = items[:a.held_out], items[a.held_out:]
    init = None
    if a.init is not None:
        with np.load(a.init, allow_pickle=False) as z:
            init = {k: z[k] for k in z.files}
    weights = train(rest, held, a.hidden, a.epochs, a.alpha, a.lsd_weight, a.lr, seed=a.seed, init=init, log=log)
    np.savez(a.out / "upperband.npz", **weights)
    (a.out / "train.json").write_text(json.dumps(vars(a), indent=1, default=str))  # paths as text
    log(f"wrote {a.out / 'upperband.npz'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
