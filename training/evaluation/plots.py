"""`enhancer-train plot`: figures as PNG (matplotlib, Agg backend).

* one file: noisy / enhanced / clean log spectrograms and the competition scores of every TIM
  layer over time (the paper's figure 3: which mechanism wins each frame, speech vs non-speech)
* training curves from a run's metrics.csv: training loss (raw and smoothed), validation loss,
  learning rate, throughput
"""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from enhancer.config import SAMPLE_RATE

from ..data.audio_cache import read16k
from ..data.manifests import DataError


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# --------------------------------------------------------------------------- model outputs
def enhance_with_competition(model_path, noisy: np.ndarray):
    """(enhanced (n,), competition (T, n_tim, n_s) or None, hop seconds) for a checkpoint or an
    .onnx model. Frame t of the competition scores covers samples around t * hop."""
    model_path = Path(model_path)
    if not model_path.is_file():
        raise FileNotFoundError(f"model not found: {model_path}")
    if model_path.suffix == ".onnx":
        from enhancer.runtime import Enhancer

        enh = Enhancer.from_pretrained(model_path, providers=["CPUExecutionProvider"])
        s = enh.stream(SAMPLE_RATE, 1, metadata=True)
        head = s.feed(noisy)
        meta = s.metadata.pop()  # one entry per step; flush() below starts a fresh stream
        out = np.concatenate([head, s.flush()])
        comp = None if not meta or meta[0].competition is None else np.stack([m.competition[0] for m in meta])
        hop = enh.config.stft.hop
        if comp is not None:  # the stream is delayed by (lookahead + 1) hops: realign to input frames
            comp = comp[enh.config.lookahead:]
        return out, comp, hop / SAMPLE_RATE
    import torch

    from enhancer import load_checkpoint
    from enhancer.build.model import features

    model = load_checkpoint(model_path)
    cfg = model.config
    with torch.no_grad():
        x = torch.from_numpy(noisy)[None]  # (1, n)
        logmag = features.log_magnitude(features.stft(x, cfg.stft), cfg.log_eps)  # (1, T, F)
        _, comp = model(logmag)  # (1, T, n_tim, n_s) or None
        enhanced = model.enhance(x)[0].numpy()
    return enhanced, (None if comp is None else comp[0].numpy()), cfg.stft.hop / SAMPLE_RATE


def log_spectrogram(x: np.ndarray) -> np.ndarray:
    from enhancer.signal import stft

    return 20.0 * np.log10(np.abs(stft(x)) + 1e-5).T  # (F, T) dB


# --------------------------------------------------------------------------- figures
def plot_example(model_path, noisy_path, out, clean_path=None, title: str | None = None) -> Path:
    noisy = read16k(noisy_path)
    clean = read16k(clean_path) if clean_path else None
    enhanced, comp, hop_s = enhance_with_competition(model_path, noisy)
    specs = [("noisy", noisy), ("enhanced", enhanced)] + ([("clean", clean)] if clean is not None else [])
    n_tim = 0 if comp is None else comp.shape[1]
    plt = _pyplot()
    fig, axes = plt.subplots(len(specs) + n_tim, 1, sharex=True, figsize=(10, 2.2 * len(specs) + 1.1 * n_tim + 0.6),
                             gridspec_kw={"height_ratios": [2.0] * len(specs) + [1.0] * n_tim}, squeeze=False)
    axes = axes[:, 0]
    vmax = max(log_spectrogram(s).max() for _, s in specs)
    for ax, (name, sig) in zip(axes, specs):
        spec = log_spectrogram(sig)
        ax.imshow(spec, origin="lower", aspect="auto", cmap="magma", vmin=vmax - 90, vmax=vmax,
                  extent=(0, len(sig) / SAMPLE_RATE, 0, SAMPLE_RATE / 2000))
        ax.set_ylabel(f"{name}\nkHz")
    for j in range(n_tim):
        ax = axes[len(specs) + j]
        t = np.arange(comp.shape[0]) * hop_s
        for k in range(comp.shape[2]):
            ax.plot(t, comp[:, j, k], lw=0.9, label=f"mechanism {k + 1}")
        ax.set_ylim(-0.05, 1.05)
        ax.set_ylabel(f"TIM layer {j + 1}", fontsize=8)
        if j == 0:
            ax.legend(loc="upper right", fontsize=7, ncol=comp.shape[2])
    axes[-1].set_xlim(0, len(noisy) / SAMPLE_RATE)
    axes[-1].set_xlabel("time (s)")
    fig.suptitle(title or f"{Path(noisy_path).name}: spectrograms" + (" and competition scores" if n_tim else ""))
    fig.tight_layout()
    return _save(fig, out)


def read_metrics(path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"metrics file not found: {path}")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise DataError(f"{path} has no rows yet")
    return rows


def plot_curves(metrics_path, out, smooth: int = 20) -> Path:
    rows = read_metrics(metrics_path)

    def col(split, key):
        r = [x for x in rows if x["split"] == split]
        return np.array([float(x["step"]) for x in r]), np.array([float(x[key]) for x in r])

    plt = _pyplot()
    fig, (ax_loss, ax_lr, ax_rate) = plt.subplots(3, 1, sharex=True, figsize=(9, 7),
                                                  gridspec_kw={"height_ratios": [3, 1, 1]})
    s, loss = col("train", "loss")
    if len(s):
        ax_loss.plot(s, loss, color="C0", alpha=0.25, lw=0.8, label="train")
        if len(loss) >= smooth:
            k = np.ones(smooth) / smooth
            ax_loss.plot(s[smooth - 1:], np.convolve(loss, k, mode="valid"), color="C0", lw=1.5, label=f"train (mean of {smooth})")
    vs, vl = col("valid", "loss")
    if len(vs):
        ax_loss.plot(vs, vl, "o-", color="C3", ms=3, label="validation")
        b = int(np.argmin(vl))
        ax_loss.annotate(f"best {vl[b]:.4f}", (vs[b], vl[b]), textcoords="offset points", xytext=(5, 8), fontsize=8)
    ax_loss.set_ylabel("log-magnitude MSE")
    ax_loss.set_yscale("log")
    ax_loss.legend(fontsize=8)
    ax_loss.grid(alpha=0.3, which="both")
    ss, lr = col("train", "lr")
    ax_lr.plot(ss, lr, color="C2")
    ax_lr.set_yscale("log")
    ax_lr.set_ylabel("lr")
    rs, rate = col("train", "audio_s_per_s")
    ok = np.isfinite(rate)
    ax_rate.plot(rs[ok], rate[ok], color="C1", lw=0.8)
    ax_rate.set_ylabel("audio s / s")
    ax_rate.set_xlabel("step")
    for ax in (ax_lr, ax_rate):
        ax.grid(alpha=0.3)
    fig.suptitle(f"training curves: {Path(metrics_path).parent.name}")
    fig.tight_layout()
    return _save(fig, out)


def _save(fig, out) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return out


# --------------------------------------------------------------------------- CLI
def add_plot(sub) -> None:
    p = sub.add_parser("plot", help="spectrogram/competition figure of one file, or training curves",
                       description="With --model and --noisy: noisy/enhanced/clean spectrograms and the competition "
                                   "scores of each TIM layer. With --metrics (or --run): the training curves.")
    p.add_argument("--model", type=Path, help="checkpoint (.pt) or exported .onnx model")
    p.add_argument("--noisy", type=Path, help="noisy audio file")
    p.add_argument("--clean", type=Path, help="clean reference (optional)")
    p.add_argument("--metrics", type=Path, help="metrics.csv of a training run")
    p.add_argument("--run", type=Path, help="a training run folder (uses RUN/metrics.csv)")
    p.add_argument("--smooth", type=int, default=20, help="rows averaged for the smoothed training loss")
    p.add_argument("--out", type=Path, required=True, help="PNG file to write")
    p.set_defaults(func=cmd_plot)


def cmd_plot(args) -> int:
    metrics = args.metrics or (args.run / "metrics.csv" if args.run else None)
    if metrics is not None:
        if args.model or args.noisy:
            raise DataError("plot either training curves (--metrics/--run) or one file (--model, --noisy)")
        path = plot_curves(metrics, args.out, args.smooth)
    elif args.model and args.noisy:
        path = plot_example(args.model, args.noisy, args.out, args.clean)
    else:
        raise DataError("give --model and --noisy (figure of one file) or --metrics/--run (training curves)")
    print(path)
    return 0
