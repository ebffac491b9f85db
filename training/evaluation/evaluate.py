"""`enhancer-train eval`: enhance paired noisy/clean folders and score input and output side by side.

The model is an exported `.onnx` step graph (run by the numpy/onnxruntime runtime) or a training
checkpoint (run by the torch offline reference; with `--streaming` it is exported first). With
`--streaming` every file goes through the streaming runtime in random chunk sizes. `--oracle` scores
the ideal gain instead of a model: each bin of the model's STFT scaled by the clean magnitude over
the noisy, at most 1, and resynthesised with the noisy phase (`OracleRunner`), the best any model
with this output (a gain in [0, 1] on the noisy magnitude) can do on the files. Everything is
scored at 16 kHz. Writes:

    OUT/summary.json   {"files": N, "noisy": {"pesq_wb", "stoi", "estoi", "si_sdr", "dnsmos_ovrl", ...}, "enhanced": {...}}
    OUT/per_file.csv   one row per file, noisy_* and enhanced_* columns
    OUT/summary.md     a markdown table of the means
    OUT/enhanced/      the enhanced audio (16 kHz WAV), unless --no-audio
"""
from __future__ import annotations

import csv
import json
import math
import os
import re
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from enhancer.config import SAMPLE_RATE

from ..data.audio_cache import read16k
from ..data.layouts import Pair, dns_test_pairs, paired_folders, voicebank_test_pairs
from ..data.manifests import DataError
from .devnames import KINDS, kind_of
from .metrics import DNSMOS_KEYS, INTRUSIVE, LABELS


# --------------------------------------------------------------------------- models
class ModelRunner:
    """16 kHz mono in, 16 kHz mono out, for an .onnx model or a checkpoint."""

    def __init__(self, path, streaming: bool = False, seed: int = 0, work_dir=None, atten_lim_db: float | None = None):
        from enhancer.runtime import min_gain_for

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"model not found: {path}")
        self.path, self.streaming = path, streaming
        self.atten_lim_db, self.min_gain = atten_lim_db, min_gain_for(atten_lim_db)  # checked before loading
        self.rng = np.random.default_rng(seed)
        self.torch_model = None
        self.enhancer = None
        if path.suffix == ".onnx":
            self._load_onnx(path)
        else:
            from enhancer import load_checkpoint

            model = load_checkpoint(path)
            if streaming:
                from enhancer.build.export import export_step

                onnx_path = Path(work_dir or tempfile.mkdtemp()) / (path.stem + ".onnx")
                export_step(model, onnx_path, check=False)
                self._load_onnx(onnx_path)
            else:
                self.torch_model = model

    def _load_onnx(self, path: Path) -> None:
        from enhancer.runtime import Enhancer

        self.enhancer = Enhancer.from_pretrained(path, providers=["CPUExecutionProvider"])

    def __call__(self, x: np.ndarray, clean: np.ndarray | None = None) -> np.ndarray:
        if self.torch_model is not None:
            import torch

            with torch.no_grad():
                return self.torch_model.enhance(torch.from_numpy(x)[None], min_gain=self.min_gain)[0].numpy()
        if not self.streaming:
            return self.enhancer.enhance(x, SAMPLE_RATE, atten_lim_db=self.atten_lim_db)
        s = self.enhancer.stream(SAMPLE_RATE, 1, atten_lim_db=self.atten_lim_db)
        out, i = [], 0
        while i < len(x):
            n = int(self.rng.integers(1, 4097))  # random chunk sizes, 1 sample .. 256 ms
            out.append(s.feed(x[i:i + n]))
            i += n
        out.append(s.flush())
        return np.concatenate(out)


class OracleRunner:
    """The ideal gain of the model's output: min(|S| / |X|, 1) on the STFT the model uses (512
    points, 16 ms hop, sqrt-Hann), applied to the noisy spectrum X and resynthesised with its phase.
    It needs the clean speech S, sample-aligned with the noisy input (`evaluate` checks that every
    pair has one before it starts)."""

    def __call__(self, x: np.ndarray, clean: np.ndarray) -> np.ndarray:
        from enhancer.signal import istft, stft

        if len(clean) != len(x):
            raise DataError(f"--oracle needs sample-aligned pairs: the clean file has {len(clean)} samples, "
                            f"the noisy one {len(x)}")
        noisy_spec, clean_spec = stft(x), stft(clean)
        mag = np.abs(noisy_spec)
        gain = np.minimum(np.abs(clean_spec) / np.maximum(mag, np.finfo(np.float32).tiny), 1.0)
        return istft(noisy_spec * gain, len(x))


# --------------------------------------------------------------------------- scoring (worker side)
_DNSMOS = None


def _init_worker(dnsmos_dir) -> None:
    global _DNSMOS
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if dnsmos_dir is not None:
        from .dnsmos import DNSMOS

        _DNSMOS = DNSMOS(dnsmos_dir)


def score_signals(clean: np.ndarray | None, noisy: np.ndarray, enhanced: np.ndarray) -> dict[str, float]:
    """noisy_* and enhanced_* metrics (intrusive ones only with a clean reference)."""
    from . import metrics

    row = {}
    for tag, x in (("noisy", noisy), ("enhanced", enhanced)):
        if clean is not None:
            for k, v in metrics.intrusive(clean, x).items():
                row[f"{tag}_{k}"] = v
        if _DNSMOS is not None:
            d = _DNSMOS.score(x)
            for k in ("sig", "bak", "ovrl"):
                row[f"{tag}_dnsmos_{k}"] = d[k]
    return row


def _score_job(args):
    name, clean, noisy, enhanced = args
    return name, score_signals(clean, noisy, enhanced)


# --------------------------------------------------------------------------- driver
def evaluate(model, pairs: list[Pair], out, streaming: bool = False, dnsmos_dir=None, jobs: int = 1,
             write_audio: bool = True, seed: int = 0, log=None, progress: bool = True,
             atten_lim_db: float | None = None, oracle: bool = False) -> dict:
    """Enhance and score every pair; write the reports to `out`; return the summary. Says what it
    scores and shows a progress bar on stderr (`progress=False`: neither). `oracle`: score
    `OracleRunner` instead of a model (`model` is then None)."""
    from tqdm import tqdm

    log = log or ((lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None))
    if not pairs:
        raise DataError("nothing to evaluate: no file pairs")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    has_clean = all(p.clean is not None for p in pairs)
    if oracle:
        if not has_clean:
            raise DataError("--oracle needs the clean reference of every file (--clean)")
        if streaming or atten_lim_db is not None:
            raise DataError("--oracle takes neither --streaming nor --atten-lim-db")
        runner, model = OracleRunner(), "oracle (ideal gain)"
    else:
        runner = ModelRunner(model, streaming, seed, work_dir=out, atten_lim_db=atten_lim_db)
    if not has_clean and any(p.clean is not None for p in pairs):
        raise DataError("some files have a clean reference and some do not")
    if not has_clean and dnsmos_dir is None:
        raise DataError("without clean references only DNSMOS can score; give --dnsmos DIR")
    jobs = max(1, int(jobs))
    pool = ProcessPoolExecutor(jobs, initializer=_init_worker, initargs=(dnsmos_dir,)) if jobs > 1 else None
    if pool is None:
        _init_worker(dnsmos_dir)
    metrics_named = ([LABELS[k].split(" (")[0] for k in INTRUSIVE] if has_clean else []) + (["DNSMOS"] if dnsmos_dir else [])
    log(f"evaluating {model} on {len(pairs)} file(s){' (streaming)' if streaming else ''}: enhancing, then scoring "
        f"noisy and enhanced with {', '.join(metrics_named)}{f' in {jobs} processes' if jobs > 1 else ''}")
    rows, futures, seconds = {}, [], {}
    bar = tqdm(total=len(pairs), desc="enhance + score" if pool is None else "enhance", unit="file", disable=not progress)
    try:
        for pair in pairs:
            noisy = read16k(pair.noisy)
            clean = read16k(pair.clean) if pair.clean is not None else None
            enhanced = runner(noisy, clean)  # (n,) 16 kHz
            seconds[pair.name] = len(noisy) / SAMPLE_RATE
            if write_audio:
                import soundfile as sf

                dest = out / "enhanced" / pair.name
                dest.parent.mkdir(parents=True, exist_ok=True)
                sf.write(str(dest.with_suffix(".wav")), enhanced, SAMPLE_RATE, subtype="FLOAT")
            job = (pair.name, clean, noisy, enhanced)
            if pool is None:
                name, row = _score_job(job)
                rows[name] = row
            else:
                futures.append(pool.submit(_score_job, job))
            bar.update()
        bar.close()
        for f in tqdm(futures, desc="score", unit="file", disable=not progress or not futures):
            name, row = f.result()
            rows[name] = row
    finally:
        bar.close()
        if pool is not None:
            pool.shutdown()
    return write_reports(out, pairs, rows, seconds, model, streaming, atten_lim_db)


def _mean(values) -> float | None:
    v = [x for x in values if x is not None and math.isfinite(x)]
    return float(np.mean(v)) if v else None


def write_reports(out: Path, pairs: list[Pair], rows: dict, seconds: dict, model, streaming: bool,
                  atten_lim_db: float | None = None) -> dict:
    keys = [k for k in INTRUSIVE + DNSMOS_KEYS if f"noisy_{k}" in next(iter(rows.values()))]
    names = [p.name for p in pairs]
    summary = {"files": len(names), "model": str(model), "streaming": streaming, "atten_lim_db": atten_lim_db,
               "seconds": round(sum(seconds.values()), 3)}
    for tag in ("noisy", "enhanced"):
        summary[tag] = {k: _mean(rows[n][f"{tag}_{k}"] for n in names) for k in keys}
    groups = subsets(names)
    if len(groups) > 1:
        summary["subsets"] = {g: {"files": len(members), **{tag: {k: _mean(rows[n][f"{tag}_{k}"] for n in members)
                                                                for k in keys} for tag in ("noisy", "enhanced")}}
                              for g, members in groups.items()}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with open(out / "per_file.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["name", "seconds"] + [f"{t}_{k}" for k in keys for t in ("noisy", "enhanced")])
        for n in names:
            w.writerow([n, f"{seconds[n]:.3f}"] + [f"{rows[n][f'{t}_{k}']:.4f}" for k in keys for t in ("noisy", "enhanced")])
    (out / "summary.md").write_text(markdown_table(summary, keys))
    return summary


_SNR_NAME = re.compile(r"snr(-?\d+)")


def subsets(names: list[str]) -> dict[str, list[str]]:
    """The dev sets' subsets by file name: `snr-05_music_0007.wav` is in "-5 dB" and "music",
    `real_p287_001.wav` in "real"; in SNR order, then the kinds."""
    by_snr, by_kind = {}, {}
    for n in names:
        kind = kind_of(n)
        if kind is not None:
            by_kind.setdefault(kind, []).append(n)
        m = _SNR_NAME.match(Path(n).name)
        if m and kind != "real":
            by_snr.setdefault(int(m.group(1)), []).append(n)
    out = {f"{snr} dB": by_snr[snr] for snr in sorted(by_snr)}
    out.update({k: by_kind[k] for k in KINDS if k in by_kind})
    return out


def markdown_table(summary: dict, keys) -> str:
    def fmt(v):
        return "n/a" if v is None else f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"

    lines = [f"{summary['files']} files, {summary['seconds'] / 60:.1f} min; model `{summary['model']}`"
             f"{' (streaming, random chunks)' if summary['streaming'] else ''}", "",
             "| metric | noisy | enhanced | change |", "|---|---:|---:|---:|"]
    for k in keys:
        a, b = summary["noisy"][k], summary["enhanced"][k]
        d = None if a is None or b is None else b - a
        lines.append(f"| {LABELS[k]} | {fmt(a)} | {fmt(b)} | {'n/a' if d is None else f'{d:+.3f}'} |")
    if summary.get("subsets"):
        lines += ["", "| subset | files | " + " | ".join(f"{LABELS[k]} noisy | {LABELS[k]} enhanced" for k in keys) + " |",
                  "|---|---:|" + "---:|" * (2 * len(keys))]
        for g, sub in summary["subsets"].items():
            lines.append(f"| {g} | {sub['files']} | "
                         + " | ".join(f"{fmt(sub['noisy'][k])} | {fmt(sub['enhanced'][k])}" for k in keys) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- CLI
def add_eval(sub, dnsmos_dir: Path | None = None) -> None:
    """`eval`; `dnsmos_dir`: the default of --dnsmos (the CLI passes the models beside the checkout)."""
    p = sub.add_parser("eval", help="score a model on paired noisy/clean folders",
                       description="Enhance noisy files and report PESQ-WB, STOI, ESTOI, SI-SDR, the speech level and DNSMOS "
                                   "for the noisy input and the enhanced output.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", type=Path, help="exported .onnx model or training checkpoint (.pt)")
    what.add_argument("--oracle", action="store_true",
                      help="score the ideal gain instead of a model: the clean magnitude over the noisy, at most 1, "
                           "with the noisy phase (needs --clean)")
    src = p.add_argument_group("files (one of)")
    src.add_argument("--noisy", type=Path, help="folder of noisy files")
    src.add_argument("--clean", type=Path, help="folder of clean references (same names or fileid_N); optional")
    src.add_argument("--dns-root", type=Path, help="DNS-Challenge checkout: test_set/synthetic/no_reverb/{noisy,clean}")
    src.add_argument("--vb-root", type=Path, help="Voicebank+DEMAND folder: noisy_testset_wav/, clean_testset_wav/")
    p.add_argument("--out", type=Path, required=True, help="report folder")
    p.add_argument("--streaming", action="store_true", help="run through the streaming runtime in random chunk sizes")
    p.add_argument("--dnsmos", type=Path, help="DNSMOS model folder (default: ../shared/data/dnsmos if present)")
    p.set_defaults(default_dnsmos=dnsmos_dir)
    p.add_argument("--no-dnsmos", action="store_true", help="skip DNSMOS")
    p.add_argument("--jobs", type=int, default=1, help="processes scoring files in parallel")
    p.add_argument("--limit", type=int, help="score only the first N pairs")
    p.add_argument("--no-audio", action="store_true", help="do not write the enhanced audio")
    p.add_argument("--seed", type=int, default=0, help="seed of the random chunk sizes of --streaming")
    p.add_argument("--atten-lim-db", type=float, default=None, metavar="DB",
                   help="attenuation limit of the enhancer, as the service's atten_lim_db (default: none)")
    p.set_defaults(func=cmd_eval)


def eval_pairs(args) -> list[Pair]:
    given = [n for n in ("noisy", "dns_root", "vb_root") if getattr(args, n)]
    if len(given) != 1:
        raise DataError("give exactly one of --noisy DIR [--clean DIR], --dns-root DIR, --vb-root DIR")
    if args.noisy:
        return paired_folders(args.noisy, args.clean)
    if args.clean:
        raise DataError("--clean goes with --noisy")
    return dns_test_pairs(args.dns_root) if args.dns_root else voicebank_test_pairs(args.vb_root)


def cmd_eval(args) -> int:
    pairs = eval_pairs(args)
    if args.limit:
        pairs = pairs[: args.limit]
    dnsmos_dir = None if args.no_dnsmos else (args.dnsmos or args.default_dnsmos)
    if args.dnsmos and not args.dnsmos.is_dir():
        raise DataError(f"--dnsmos: folder not found: {args.dnsmos}")
    summary = evaluate(args.model, pairs, args.out, args.streaming, dnsmos_dir, args.jobs, not args.no_audio, args.seed,
                       atten_lim_db=args.atten_lim_db, oracle=args.oracle)
    print((Path(args.out) / "summary.md").read_text(), end="")
    return 0 if summary["files"] else 1
