"""The dev test set: built once from the corpus's *validation* speakers and noises, never trained on.

    enhancer-train devset --data ../enhancer-data --out ../enhancer-devset

writes `OUT/noisy/*.wav` and `OUT/clean/*.wav` (16 kHz, 16-bit, same names in both folders) and
`OUT/manifest.tsv`: `n` mixtures of 8-10 s, spread evenly over the SNRs {0, 5, 10, 15, 20} dB, with
the DNS-style mixer (speech level -35..-15 dBFS, noise / music / babble of validation talkers),
named `snr05_0042.wav`; plus the real Voicebank+DEMAND p287 pairs from the shared data as
`real_p287_00N.wav`. The same seed and data give the same files.

    enhancer-train devset --unseen --data ../enhancer-data --out ../enhancer-devset-unseen

builds the *unseen-source* dev set instead: the noises and music come only from the sources that
`training.data.holdout` keeps out of training whole (not one file of them is trained on), the speech and
babble talkers from the validation speakers, at {-5, 0, 5, 10, 15, 20} dB, one noise category per
file in turn (environmental noise, music, babble), named `snr-05_music_0007.wav`; plus the real
p287 pairs. This is the set checkpoints are selected on (`fit --dev`).
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np

from enhancer.config import SAMPLE_RATE

from ..data.audio_cache import cached_audio, stderr_log
from ..data.layouts import corpus_layout
from ..data.manifests import DataError
from ..data.synthesis import MixConfig, Synthesizer

SNRS = (0, 5, 10, 15, 20)
UNSEEN_SNRS = (-5, 0, 5, 10, 15, 20)
UNSEEN_KINDS = ("noise", "music", "babble")  # one per file in turn
DEV_SEED = 20261121
UNSEEN_SEED = 20261122


def build_devset(data_root, out, n: int = 150, seconds: tuple[float, float] = (8.0, 10.0), snrs=SNRS,
                 seed: int = DEV_SEED, real_pairs=None, cache_root=None, log=stderr_log,
                 unseen: bool = False) -> Path:
    """Write the dev test set into `out` (replaced if it exists). Returns `out`. With `unseen`, the
    unseen-source set (module docstring). `real_pairs`: a folder of real noisy/ and clean/ pairs to
    add (the CLI's default: the p287 pairs beside the checkout); None: none."""
    import soundfile as sf

    data = corpus_layout(data_root, hold_out=unseen)
    v = data.valid
    speech = cached_audio(v["speech"], "speech_valid", cache_root, log=log)
    if unseen:
        if not data.unseen.get("noise") or not data.unseen.get("music"):
            raise DataError(f"{data_root}: the corpus holds none of the held-out noise/music sources "
                            "(training.data.holdout.UNSEEN_SOURCES); rebuild it with materialize.sh")
        noise = cached_audio(data.unseen["noise"], "noise_unseen", cache_root, log=log)
        music = cached_audio(data.unseen["music"], "music_unseen", cache_root, log=log)
    else:
        noise = cached_audio(v["noise"], "noise_valid", cache_root, log=log)
        music = cached_audio(v["music"], "music_valid", cache_root, log=log) if v.get("music") else None
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "noisy").mkdir(parents=True)
    (tmp / "clean").mkdir()
    rows = ["file\tsnr_db\tlevel_db\tnoise\tspeaker\tbandwidth_hz\tseconds"]
    base = MixConfig(p_clean=0.0)
    rng = np.random.default_rng(seed)
    lengths = rng.uniform(*seconds, size=n)
    for i in range(n):
        snr = float(snrs[i % len(snrs)])
        cfg = dataclasses.replace(base, segment_seconds=float(lengths[i]), snr_db=(snr, snr))
        if unseen:
            kind = UNSEEN_KINDS[(i // len(snrs)) % len(UNSEEN_KINDS)]
            cfg = dataclasses.replace(cfg, p_music=float(kind == "music"), p_babble=float(kind == "babble"))
            name = f"snr{int(snr):03d}_{kind}_{i:04d}.wav"
        else:
            name = f"snr{int(snr):02d}_{i:04d}.wav"
        ex = Synthesizer(speech, noise, music, cfg, seed=seed).example(i)
        sf.write(tmp / "noisy" / name, ex.noisy, SAMPLE_RATE, subtype="PCM_16")
        sf.write(tmp / "clean" / name, ex.clean, SAMPLE_RATE, subtype="PCM_16")
        rows.append(f"{name}\t{snr:g}\t{ex.info['level_db']:.2f}\t{ex.info['noise']}\t{ex.info['group']}\t"
                    f"{ex.bandwidth_hz:g}\t{len(ex.clean) / SAMPLE_RATE:.3f}")
    n_real = 0
    if real_pairs is not None and Path(real_pairs).is_dir():
        for noisy in sorted((Path(real_pairs) / "noisy").glob("*.wav")):
            clean = Path(real_pairs) / "clean" / noisy.name
            if clean.is_file():
                name = f"real_{noisy.name}"
                shutil.copyfile(noisy, tmp / "noisy" / name)
                shutil.copyfile(clean, tmp / "clean" / name)
                info = sf.info(str(clean))
                rows.append(f"{name}\t\t\treal\tvoicebank p287\t{info.samplerate / 2:g}\t{info.duration:.3f}")
                n_real += 1
    (tmp / "manifest.tsv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    log(f"dev set: {n} mixtures ({', '.join(f'{s} dB' for s in snrs)}) + {n_real} real pairs in {out}")
    return out


def add_devset(sub, real_pairs: Path | None = None) -> None:
    """`devset`; `real_pairs`: the default of --real-pairs."""
    p = sub.add_parser("devset", help="build the dev test set from the validation speakers and noises")
    p.add_argument("--data", required=True, help="corpus root with manifests/ (materialize.sh output)")
    p.add_argument("--out", required=True, help="output folder (noisy/, clean/, manifest.tsv)")
    p.add_argument("-n", type=int, help="number of mixtures (default 150; 180 with --unseen)")
    p.add_argument("--seed", type=int, help=f"mixing seed (default {DEV_SEED}; {UNSEEN_SEED} with --unseen)")
    p.add_argument("--unseen", action="store_true",
                   help="noise and music only from the sources held out of training whole (training.data.holdout), "
                        "-5..20 dB, one category per file in turn: the set to select checkpoints on")
    p.add_argument("--real-pairs", default="" if real_pairs is None else str(real_pairs),
                   help="folder with noisy/ and clean/ real pairs ('' for none; default: ../shared/data/dev/valentini_p287)")
    p.set_defaults(func=cmd_devset)


def cmd_devset(args) -> int:
    try:
        if args.unseen:
            build_devset(args.data, args.out, n=args.n or 180, seed=UNSEEN_SEED if args.seed is None else args.seed,
                         snrs=UNSEEN_SNRS, real_pairs=args.real_pairs or None, unseen=True)
        else:
            build_devset(args.data, args.out, n=args.n or 150, seed=DEV_SEED if args.seed is None else args.seed,
                         real_pairs=args.real_pairs or None)
    except DataError as e:
        stderr_log(f"error: {e}")
        return 2
    return 0
