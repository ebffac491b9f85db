"""`enhancer-train competition`: do the TIM mechanisms specialise on speech (the paper's figure 3)?

For paired noisy/clean folders, the model's competition scores (T, n_tim, n_s) on the noisy file
are set against the speech activity of the clean reference, frame by frame (STFT frame t is
centred on sample t * hop, the frame the competition score t belongs to, as in `plot_example`).

* speech activity: a clean frame is active when its energy (sum of |STFT|^2, sqrt-Hann window,
  hop 256 at 16 kHz) is within SPEECH_RANGE_DB of the clip's loudest frames, i.e. above the
  SPEECH_REF_PERCENTILE-th percentile frame energy (in dB) minus SPEECH_RANGE_DB, and above
  ENERGY_FLOOR (digital silence is never speech). The reference assumes speech fills more than
  100 - SPEECH_REF_PERCENTILE % of a clip.
* per layer and mechanism: Pearson r between the score and the 0/1 activity, pooled over all
  frames of all clips (and the mean of the per-clip r); a layer's speech mechanism is the one
  with the highest pooled r
* per layer: mean competition entropy in bits (max log2(n_s)) and mean max score (confidence)
* mechanisms specialise when some layer has a mechanism with |r| > SPECIALISATION_R; confidence
  grows with depth when the least-squares slope of the entropy over layers is below 0

Writes OUT/competition.json, OUT/competition.md and OUT/competition.png.
"""
from __future__ import annotations

import json
import math
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from enhancer.config import SAMPLE_RATE

from ..data.audio_cache import read16k
from ..data.manifests import DataError
from .plots import _pyplot, _save, enhance_with_competition, log_spectrogram

SPEECH_RANGE_DB = 20.0  # active: within this many dB of the loudest frames (real "clean" references have noise floors ~30 dB down)
SPEECH_REF_PERCENTILE = 95.0  # "loudest frames": this percentile of the clip's frame energies (dB)
ENERGY_FLOOR = 1e-10  # frames at or below this energy (sum |X|^2) are silence
SPECIALISATION_R = 0.3  # |Pearson r| above which a mechanism counts as specialised on speech
ENTROPY_SLOPE_MAX = 0.0  # confidence grows with depth when the entropy slope (bits/layer) is below this


# --------------------------------------------------------------------------- measures
def frame_energy_db(x: np.ndarray, n_frames: int | None = None) -> np.ndarray:
    """x: (n,) 16 kHz -> (T,) frame energy in dB, frames as `enhancer.signal.stft`."""
    from enhancer.signal import stft

    e = (np.abs(stft(x, n_frames=n_frames)) ** 2).sum(-1)  # (T,)
    return 10.0 * np.log10(e.astype(np.float64) + ENERGY_FLOOR)


def speech_activity(clean: np.ndarray, n_frames: int | None = None) -> np.ndarray:
    """(T,) bool: frame energy above the SPEECH_REF_PERCENTILE-th percentile minus SPEECH_RANGE_DB,
    and above ENERGY_FLOOR."""
    e_db = frame_energy_db(clean, n_frames)
    ref = np.percentile(e_db, SPEECH_REF_PERCENTILE)
    floor_db = 10.0 * np.log10(2 * ENERGY_FLOOR)
    return (e_db > ref - SPEECH_RANGE_DB) & (e_db > floor_db)


def pearson(a, b) -> float:
    """Pearson correlation of two (n,) series; nan when either is constant."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    a, b = a - a.mean(), b - b.mean()
    den = math.sqrt(float((a * a).sum()) * float((b * b).sum()))
    return float((a * b).sum() / den) if den > 0 else math.nan


def entropy_bits(scores: np.ndarray) -> np.ndarray:
    """Entropy in bits over the last axis (scores sum to 1 there): (..., n_s) -> (...)."""
    p = np.asarray(scores, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, -p * np.log2(np.where(p > 0, p, 1.0)), 0.0)
    return terms.sum(-1)


def depth_trend(values) -> tuple[float, float]:
    """(least-squares slope per layer, Spearman rho against layer index); nan with < 2 layers."""
    v = np.asarray(values, dtype=np.float64)
    if len(v) < 2:
        return math.nan, math.nan
    layers = np.arange(len(v), dtype=np.float64)
    slope = float(np.polyfit(layers, v, 1)[0])
    from scipy.stats import rankdata

    return slope, pearson(rankdata(layers), rankdata(v))


# --------------------------------------------------------------------------- analysis
@dataclass
class Clip:
    name: str
    activity: np.ndarray  # (T,) bool
    comp: np.ndarray  # (T, n_tim, n_s)


def clip_from_audio(name: str, clean: np.ndarray, comp: np.ndarray) -> Clip:
    """Align the clean reference's activity with the competition frames (frame t at t * hop)."""
    from enhancer.signal import n_frames_for

    n = min(comp.shape[0], n_frames_for(len(clean)))
    return Clip(name, speech_activity(clean)[:n], comp[:n])


def _nanmean(v) -> float:
    v = np.asarray(v, dtype=np.float64)
    v = v[np.isfinite(v)]
    return float(v.mean()) if len(v) else math.nan


def analyse(clips: list[Clip], model: str = "", hop_s: float = 256 / SAMPLE_RATE) -> dict:
    """Per-layer correlation, entropy and confidence, and the summary (see the module docstring)."""
    if not clips:
        raise DataError("no clips to analyse")
    act = np.concatenate([c.activity for c in clips]).astype(np.float64)  # (N,)
    comp = np.concatenate([c.comp for c in clips]).astype(np.float64)  # (N, n_tim, n_s)
    _, n_tim, n_s = comp.shape
    ent = entropy_bits(comp)  # (N, n_tim)
    conf = comp.max(-1)  # (N, n_tim)
    layers = []
    for j in range(n_tim):
        r = [pearson(comp[:, j, k], act) for k in range(n_s)]
        r_clip = [_nanmean([pearson(c.comp[:, j, k], c.activity) for c in clips]) for k in range(n_s)]
        best = None if all(math.isnan(x) for x in r) else int(np.nanargmax(r))
        layers.append({
            "layer": j + 1,
            "speech_mechanism": None if best is None else best + 1,
            "speech_r": None if best is None else r[best],
            "r": r,
            "r_clip_mean": r_clip,
            "max_abs_r": max((abs(x) for x in r if not math.isnan(x)), default=math.nan),
            "entropy_bits": float(ent[:, j].mean()),
            "confidence": float(conf[:, j].mean()),
        })
    spec_layers = [L["layer"] for L in layers if L["max_abs_r"] > SPECIALISATION_R]
    slope, rho = depth_trend([L["entropy_bits"] for L in layers])
    result = {
        "model": model,
        "files": len(clips),
        "frames": len(act),
        "seconds": round(len(act) * hop_s, 3),
        "n_tim": n_tim,
        "n_s": n_s,
        "max_entropy_bits": math.log2(n_s),
        "speech_fraction": float(act.mean()),
        "thresholds": {"speech_range_db": SPEECH_RANGE_DB, "speech_ref_percentile": SPEECH_REF_PERCENTILE,
                       "specialisation_abs_r": SPECIALISATION_R, "entropy_slope_max": ENTROPY_SLOPE_MAX},
        "layers": layers,
        "specialised": bool(spec_layers),
        "specialised_layers": spec_layers,
        "entropy_slope_bits_per_layer": slope,
        "entropy_spearman": rho,
        "confidence_grows_with_depth": bool(slope < ENTROPY_SLOPE_MAX),  # False when nan
        "example": clips[0].name,
    }
    result["summary"] = summary_sentences(result)
    return result


def summary_sentences(res: dict) -> list[str]:
    layers = res["layers"]
    top = max(layers, key=lambda L: -1.0 if math.isnan(L["max_abs_r"]) else L["max_abs_r"])
    t = SPECIALISATION_R
    if res["specialised"]:
        which = ", ".join(str(x) for x in res["specialised_layers"])
        spec = (f"Mechanisms specialise on speech: |r| > {t:.2f} between a mechanism's score and clean-speech "
                f"activity in TIM layer(s) {which} (max |r| = {top['max_abs_r']:.2f} in layer {top['layer']}).")
    else:
        spec = (f"Mechanisms do not specialise on speech: no TIM layer has |r| > {t:.2f} "
                f"(max |r| = {top['max_abs_r']:.2f} in layer {top['layer']}).")
    e0, e1 = layers[0]["entropy_bits"], layers[-1]["entropy_bits"]
    slope, rho = res["entropy_slope_bits_per_layer"], res["entropy_spearman"]
    if math.isnan(slope):
        depth = "Confidence over depth: n/a (a single TIM layer)."
    else:
        verdict = "grows" if res["confidence_grows_with_depth"] else "does not grow"
        depth = (f"Confidence {verdict} with depth: mean competition entropy goes from {e0:.3f} bits (layer 1) to "
                 f"{e1:.3f} bits (layer {len(layers)}) of at most {res['max_entropy_bits']:.3f}; least-squares slope "
                 f"{slope:+.3f} bits/layer (criterion: < {ENTROPY_SLOPE_MAX:g}), Spearman rho "
                 f"{'n/a' if math.isnan(rho) else f'{rho:+.2f}'}.")
    act = (f"Speech activity: a clean frame is active when its energy is within {SPEECH_RANGE_DB:g} dB of the "
           f"clip's {SPEECH_REF_PERCENTILE:g}th-percentile frame energy; {100 * res['speech_fraction']:.0f}% of "
           f"{res['frames']} frames ({res['files']} files) are active.")
    return [spec, depth, act]


def markdown(res: dict) -> str:
    def f(v, fmt):
        return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)

    lines = [(f"Competition vs clean-speech activity: {res['files']} files, {res['seconds'] / 60:.1f} min; "
             f"model `{res['model']}`"), "",
             "| TIM layer | speech mechanism | r | entropy (bits) | confidence |", "|---:|---:|---:|---:|---:|"]
    for L in res["layers"]:
        lines.append(f"| {L['layer']} | {f(L['speech_mechanism'], 'd')} | {f(L['speech_r'], '+.3f')} | "
                     f"{f(L['entropy_bits'], '.3f')} | {f(L['confidence'], '.3f')} |")
    return "\n".join(lines + [""] + res["summary"]) + "\n"


def _json_safe(v):
    if isinstance(v, float):
        return None if math.isnan(v) or math.isinf(v) else v
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


# --------------------------------------------------------------------------- figure
def plot_competition(res: dict, clip: Clip, clean: np.ndarray, out, hop_s: float) -> Path:
    """Example clip: clean spectrogram, speech activity, each layer's speech-mechanism score;
    below, per-layer bars of r and entropy."""
    plt = _pyplot()
    n_tim = res["n_tim"]
    heights = [2.0, 0.6] + [0.8] * n_tim + [2.2]
    fig = plt.figure(figsize=(10, sum(heights) * 0.95 + 0.6), layout="constrained")
    gs = fig.add_gridspec(len(heights), 2, height_ratios=heights)
    dur = len(clean) / SAMPLE_RATE
    ax = fig.add_subplot(gs[0, :])
    spec = log_spectrogram(clean)  # (F, T) dB
    ax.imshow(spec, origin="lower", aspect="auto", cmap="magma", vmin=spec.max() - 90, vmax=spec.max(),
              extent=(0, dur, 0, SAMPLE_RATE / 2000))
    ax.set_ylabel("clean\nkHz")
    ax.set_title(f"{clip.name}: clean speech activity and each TIM layer's speech-mechanism score", fontsize=10)
    time_axes = [ax]
    t = np.arange(len(clip.activity)) * hop_s  # frame t at t * hop, as plot_example
    ax = fig.add_subplot(gs[1, :], sharex=time_axes[0])
    ax.fill_between(t, clip.activity.astype(float), step="mid", color="C2", alpha=0.6, lw=0)
    ax.set_ylim(-0.05, 1.05)
    ax.set_yticks([0, 1])
    ax.set_ylabel("speech", fontsize=8)
    time_axes.append(ax)
    for j, L in enumerate(res["layers"]):
        k = (L["speech_mechanism"] or 1) - 1
        ax = fig.add_subplot(gs[2 + j, :], sharex=time_axes[0])
        ax.fill_between(t, clip.activity.astype(float), step="mid", color="C2", alpha=0.15, lw=0)
        ax.plot(t, clip.comp[:, j, k], lw=0.9, color="C0")
        ax.set_ylim(-0.05, 1.05)
        r = L["speech_r"]
        ax.set_ylabel(f"L{j + 1} m{k + 1}\nr={'n/a' if r is None or math.isnan(r) else f'{r:+.2f}'}", fontsize=8)
        time_axes.append(ax)
    for a in time_axes[:-1]:
        a.tick_params(labelbottom=False)
    time_axes[-1].set_xlim(0, dur)
    time_axes[-1].set_xlabel("time (s)")
    idx = np.arange(1, n_tim + 1)
    ax_r = fig.add_subplot(gs[-1, 0])
    r = [np.nan if L["speech_r"] is None else L["speech_r"] for L in res["layers"]]
    ax_r.bar(idx, r, color="C0", label="pooled r")
    k_best = [(L["speech_mechanism"] or 1) - 1 for L in res["layers"]]
    ax_r.plot(idx, [L["r_clip_mean"][k] for L, k in zip(res["layers"], k_best)], "o", color="C3", ms=4,
              label="mean per-clip r")
    for s in (-1, 1):
        ax_r.axhline(s * SPECIALISATION_R, color="0.4", ls="--", lw=0.8)
    ax_r.axhline(0, color="0.2", lw=0.6)
    ax_r.set_ylim(-1, 1.4)
    ax_r.set_xticks(idx)
    ax_r.set_xlabel("TIM layer")
    ax_r.set_ylabel("r(speech mechanism, activity)", fontsize=8)
    ax_r.legend(fontsize=7, loc="upper center", ncol=2)
    ax_e = fig.add_subplot(gs[-1, 1])
    ax_e.bar(idx, [L["entropy_bits"] for L in res["layers"]], color="C1", label="entropy")
    ax_e.plot(idx, [L["confidence"] for L in res["layers"]], "s-", color="C4", ms=4, label="confidence")
    ax_e.axhline(res["max_entropy_bits"], color="0.4", ls="--", lw=0.8, label=f"log2({res['n_s']})")
    ax_e.set_ylim(0, max(1.0, res["max_entropy_bits"]) * 1.3)
    ax_e.set_xticks(idx)
    ax_e.set_xlabel("TIM layer")
    ax_e.set_ylabel("bits / max score", fontsize=8)
    ax_e.legend(fontsize=7, loc="upper center", ncol=3)
    return _save(fig, out)


# --------------------------------------------------------------------------- driver
def _mixed(clip: Clip) -> bool:
    return bool(clip.activity.any() and not clip.activity.all())


def run_competition(model, pairs, out, log=None) -> dict:
    """Analyse every pair (noisy through the model, clean for the activity); write the three files."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if not pairs:
        raise DataError("nothing to analyse: no file pairs")
    if any(p.clean is None for p in pairs):
        raise DataError("competition analysis needs a clean reference for every noisy file (--clean DIR)")
    out = Path(out)
    clips, example, hop_s = [], None, None
    for i, pair in enumerate(pairs):
        noisy = read16k(pair.noisy)
        clean = read16k(pair.clean)
        _, comp, hop_s = enhance_with_competition(model, noisy)
        if comp is None:
            raise DataError(f"{model}: the model has no TIM layers with competition scores "
                            "(a baseline or no-competition model); nothing to analyse")
        clip = clip_from_audio(pair.name, clean, comp)
        clips.append(clip)
        if example is None or (not _mixed(example[0]) and _mixed(clip)):
            example = (clip, clean)  # the first clip with both speech and non-speech frames
        if (i + 1) % 20 == 0 or i + 1 == len(pairs):
            log(f"analysed {i + 1}/{len(pairs)} files")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = analyse(clips, str(model), hop_s)
    res["example"] = example[0].name
    out.mkdir(parents=True, exist_ok=True)
    (out / "competition.json").write_text(json.dumps(_json_safe(res), indent=2) + "\n")
    (out / "competition.md").write_text(markdown(res))
    plot_competition(res, example[0], example[1], out / "competition.png", hop_s)
    return res


# --------------------------------------------------------------------------- CLI
def add_competition(sub) -> None:
    p = sub.add_parser("competition", help="do the TIM mechanisms specialise on speech? (figure 3)",
                       description="Correlate each TIM layer's competition scores with the speech activity of the "
                                   "clean references; report competition entropy and confidence per layer.")
    p.add_argument("--model", type=Path, required=True, help="checkpoint (.pt) or exported .onnx model")
    p.add_argument("--noisy", type=Path, required=True, help="folder of noisy files")
    p.add_argument("--clean", type=Path, required=True, help="folder of clean references (same names or fileid_N)")
    p.add_argument("--out", type=Path, required=True, help="folder for competition.{json,md,png}")
    p.add_argument("--limit", type=int, help="analyse only the first N pairs")
    p.set_defaults(func=cmd_competition)


def cmd_competition(args) -> int:
    from ..data.layouts import paired_folders

    pairs = paired_folders(args.noisy, args.clean)
    if args.limit:
        pairs = pairs[: args.limit]
    run_competition(args.model, pairs, args.out)
    print((Path(args.out) / "competition.md").read_text(), end="")
    return 0
