"""Preparing a GPU stage on the CPU: `python -m tools.gpustage prepare` (see `tools.gpustage`).

Packs the corpus, tars it and splits the tar into pieces that each fit beside the working tree in
one device call, adds the wheels the device lacks and the init checkpoint to the first piece, and
writes plan.json (every file's sha256, the fit flags, the calls, the outputs) with the calls to make.
Standard library only at import: the constants are read on the device before its wheels are in.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from training.data.corpus_sources import sha256_of as sha256  # standard library only: runs before the wheels are in

ROOT = Path(__file__).resolve().parents[1]
FORMAT = "tim-enhancer-gpustage/1"
CALL_MIB, MARGIN_MIB = 64.0, 4.0
WHEELS = ("soundfile==0.14.0", "cffi==2.1.1", "soxr==1.1.0")  # not in the device image (cp312)
FIT = ("--augment --snr -5 25 --loss-floor 1e-2 --compressed-weight 20 --sisdr-weight 0.01 --overestimate-weight 2 "
       "--pesq-weight 2 --lr 5e-5 --schedule cosine --warmup-steps 50 --final-lr 2e-6 "
       "--seed 42 --valid-every 0")  # the shipped model's GPU-stage recipe; the batch and segments from `default_fit`
BATCH_AUDIO_S, MIN_SEGMENT_S = 512.0, 4.0  # that recipe's 128 x 4 s of audio per step
PACK = ("--codec-for", "speech=flac", "--quality", "0.8", "--shard-mb", "14")  # speech lossless, noise and music as Opus at 56 kbit/s
LAND = ".gpu"  # on the device: ignored, so kept on the warm machine between calls
START_MIN, CALL_MIN, END_MIN = 2.0, 0.5, 1.0  # device minutes: a start, each transfer call, the results and a margin
HOURS = ("speech_train=2", "music_train=1.5", "speech_valid=0.03", "noise_valid=0.03", "music_valid=0.03")
OUTPUTS = ("gpustage.pt", "metrics.csv", "train.json", "nvidia-smi.txt", "gpustage.log", "summary.json")
EXPECTED = {"audio_s_per_s_one_arm": [2300, 3700], "below": 2000}


class Failure(Exception):
    pass


def pack_hours(given: list[str] | None) -> list[str]:
    """`pack --max-hours` pairs: `HOURS`, then `given` (pack keeps a set's last value, so each set
    that `given` names takes its value there and every other set keeps its default)."""
    return [*HOURS, *(given or ())]


def tree_mib(root: Path = ROOT) -> float:
    """What every device call sends: tracked and untracked-not-ignored files (and shared/)."""
    try:
        names = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                               capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        return 0.0
    files = {root / n for n in names if n} | set((root / "shared").rglob("*"))
    return sum(p.stat().st_size for p in files if p.is_file()) / 2**20


def tracked(path: Path) -> str | None:
    """`path` relative to the tree when git tracks it (then it travels anyway), else None."""
    try:
        rel = path.resolve().relative_to(ROOT)
        subprocess.run(["git", "-C", str(ROOT), "ls-files", "--error-unmatch", str(rel)], capture_output=True, check=True)
        return str(rel)
    except (ValueError, OSError, subprocess.CalledProcessError):
        return None


def child_env(site: Path | None = None) -> dict:
    paths = ([str(site)] if site else []) + [str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "PYTHONUNBUFFERED": "1"}


def default_fit(cfg=None) -> list[str]:
    """`FIT` with segments long enough for a third of their frames to see the whole attention window
    of `cfg`, the init's config (`training.loop.full_window_seconds`: 6.1 s for the shipped model's
    256 frames), at least `MIN_SEGMENT_S`, and as many per batch as keep `BATCH_AUDIO_S` of audio per
    step."""
    seconds = MIN_SEGMENT_S
    if cfg is not None:
        from training.loop import full_window_seconds

        seconds = max(seconds, full_window_seconds(cfg))
    return FIT.split() + ["--batch-size", str(round(BATCH_AUDIO_S / seconds)), "--segment-seconds", f"{seconds:g}"]


def _segment_warning(cfg, fit_flags: list[str]) -> str | None:
    """fit's `context_note` for the flags' `--segment-seconds` (fit's default without it) and the
    window of `cfg`, the init's config, else None. The flags are read by fit's own parser (any
    spelling it takes; one it refuses stops `prepare` with its message, before any device time)."""
    if cfg is None:
        return None
    from training.cli import build_parser
    from training.data.synthesis import MixConfig
    from training.loop import context_note

    flags = build_parser().parse_args(["fit", "--out", "-", *fit_flags])
    if flags.config is not None:  # a model config may change the window: fit says it then
        return None
    seconds = flags.segment_seconds or MixConfig().segment_seconds
    return context_note(cfg, round(seconds * cfg.stft.sample_rate))


def prepare(a, fit_flags: list[str] | None = None) -> int:
    out = Path(a.out)
    if out.exists() and any(out.iterdir()):
        raise Failure(f"{out} is not empty: remove it first")
    ignored = ["git", "-C", str(ROOT), "check-ignore", "-q", f"{out.name}/plan.json"]
    if out.resolve().parent == ROOT and subprocess.run(ignored, check=False).returncode:
        raise Failure(f"{out.name}/ is not ignored by git: every call would carry all of it (.gitignore)")
    if a.init and not Path(a.init).is_file():
        raise Failure(f"--init {a.init}: no such file")
    model = None
    if a.init:
        from enhancer import load_checkpoint

        model = load_checkpoint(a.init)  # read once: its window sets the segments, and it may be carried
    cfg = None if model is None else model.config
    if not fit_flags:
        fit_flags = default_fit(cfg)  # long enough by construction
    elif note := _segment_warning(cfg, fit_flags):
        print(f"warning: --init {a.init}: {note}", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    first = out / "piece-00"
    first.mkdir()
    staging = Path(a.staging) if a.staging else out / "staging"
    if not a.staging:
        cmd = [sys.executable, "-m", "training.cli", "pack", "--data", str(a.data), "--out", str(staging), *PACK]
        cmd += [x for h in pack_hours(a.hours) for x in ("--max-hours", h)]
        cmd += ["--cache-dir", str(a.cache_dir)] if a.cache_dir else []
        subprocess.run(cmd, check=True, env=child_env())
    index = json.loads((staging / "index.json").read_text())
    init = None
    if a.init:
        rel = tracked(Path(a.init))
        if rel is None:  # not in the tree: carried in piece-00, as float16
            from enhancer import save_checkpoint

            save_checkpoint(model, model.config, first / "init.pt", half=True)
            rel = "piece-00/init.pt"
        init = rel
    if a.wheels:
        shutil.copytree(a.wheels, first / "wheels")
    elif not a.no_wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                        "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
                        "-d", str(first / "wheels"), *WHEELS], check=True)
    tree = tree_mib()
    piece_mib = a.piece_mb or min(60.0, CALL_MIB - MARGIN_MIB - tree)
    if piece_mib < 1 and not a.piece_mb:
        raise Failure(f"the tree is {tree:.1f} MiB: a call carries {CALL_MIB:g} MiB with it, no room for a piece")
    if tree + piece_mib > CALL_MIB - 1:
        print(f"warning: the tree ({tree:.1f} MiB) and a piece pass the {CALL_MIB:g} MiB of a call", file=sys.stderr)
    tar = out / "corpus.tar"
    with tarfile.open(tar, "w") as t:
        for f in sorted(staging.iterdir()):
            t.add(f, arcname=f"shards/{f.name}")
    extra = sum(p.stat().st_size for p in first.rglob("*") if p.is_file())
    room = int(piece_mib * 2**20) - extra
    if room < piece_mib * 2**18:
        raise Failure(f"piece-00 holds {extra / 2**20:.1f} MiB of init and wheels: raise --piece-mb")
    whole, pieces = hashlib.sha256(), []
    with open(tar, "rb") as f:
        while block := f.read(room if not pieces else int(piece_mib * 2**20)):
            whole.update(block)
            d = out / f"piece-{len(pieces):02d}"
            d.mkdir(exist_ok=True)
            (d / f"part-{len(pieces):02d}").write_bytes(block)
            pieces.append({"name": d.name, "carry": f"{out.name}/{d.name}", "files": {
                str(p.relative_to(d)): sha256(p) for p in sorted(d.rglob("*")) if p.is_file()},
                "mib": round(sum(p.stat().st_size for p in d.rglob("*") if p.is_file()) / 2**20, 2)})
    tar_bytes = tar.stat().st_size
    tar.unlink()
    if not a.staging:
        shutil.rmtree(staging)
    land, plan_path = LAND, f"{out.name}/plan.json"
    overhead = START_MIN + CALL_MIN * (len(pieces) - 1) + END_MIN
    minutes = round(min(a.minutes, a.budget - overhead), 1)
    if a.budget - overhead < 3:
        raise Failure(f"{len(pieces)} pieces leave {a.budget - overhead:.1f} of {a.budget:g} device minutes: pack less")
    run = f"PYTHONPATH=. python3 -m tools.gpustage run --plan {plan_path} --minutes {minutes:g}"
    calls = [{"carry": [p["carry"]] + ([plan_path] if k == len(pieces) - 1 else []),
              "move": f"mkdir -p {land} && rm -rf {land}/{p['name']} && mv {p['carry']} {land}/ && ls {land}",
              "run": run if k == len(pieces) - 1 else None} for k, p in enumerate(pieces)]
    for c in calls:
        c["command"] = c["move"] + (f" && {c['run']}" if c["run"] else "")
    plan = {"format": FORMAT, "land": land, "pieces": pieces, "tar": {"sha256": whole.hexdigest(), "bytes": tar_bytes},
            "init": init, "fit": fit_flags, "minutes": minutes, "calls": calls, "outputs": list(OUTPUTS),
            "expected": EXPECTED, "tree_mib": round(tree, 1),
            "pack": {k: round(v["seconds"] / 3600, 3) for k, v in index["sets"].items()}}
    (out / "plan.json").write_text(json.dumps(plan, indent=1) + "\n")
    if out.resolve().parent != ROOT:
        print(f"note: the calls name {out.name}/ at the repository root; {out} is elsewhere")
    print(f"{out}: {tar_bytes / 2**20:.1f} MiB in {len(pieces)} piece(s) of at most {piece_mib:.1f} MiB (the tree: "
          f"{tree:.1f} MiB); about {overhead + minutes:.1f} minutes of device time, {minutes:g} of them the run")
    print(f"device calls, back to back (the last with timeout_s {int(minutes * 60 + 60)}):")
    for k, c in enumerate(calls):
        print(f"{k + 1:2d}. carry {json.dumps(c['carry'])}\n    {c['command']}")
    print(f"the {overhead:g} minutes beside the run are estimates: before the last call, ask the device's status and "
          f"give the run the minutes left less {END_MIN:g} (at most 9: a call runs 10), timeout_s that x 60 + 60")
    return 0
