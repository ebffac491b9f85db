"""A GPU stage prepared on the CPU: `python -m tools.gpustage prepare` here, `run` on the GPU machine.

The GPU machine takes one bash command per call, each call sending the working tree (about 35 MiB:
the models are tracked; the corpus recipes are gzipped for this) plus a few ignored paths, 64 MiB in
all; it has no network and a few minutes of device time. So `prepare` does the slow and fallible steps here:

    python -m tools.gpustage prepare --data ../enhancer-data --out gpu-carry -- <fit flags>

packs the corpus (`enhancer-train pack`: the speech lossless, noise and music as Opus at quality
0.8, 56 kbit/s; by default (`HOURS`) 2 h of the speech, all 3.7 h of the noise and 1.5 h of the
music, 251 MiB, 11 pieces of 24.8 MiB, 2.5 minutes on the 2-core EPYC; `--hours SET=H` caps one set
instead of its default), tars it, splits the tar
into `gpu-carry/piece-NN/part-NN` of at most `--piece-mb` MiB (default: what a call leaves beside
the tree, less 4 MiB), adds to piece-00 the wheels the device's Python 3.12 lacks (soundfile, cffi,
soxr; torch, numpy, scipy, tqdm are there) and the `--init` checkpoint (as float16) unless it is a
tracked file, writes `gpu-carry/plan.json` (the sha256 of every file and of the tar, the fit flags,
the calls, the outputs) and prints the calls, to make back to back (the machine goes back after 30 s
idle): call k carries `gpu-carry/piece-k` and moves it into `.gpu/` (ignored: it stays on the warm
machine); the last also carries the plan and runs, with the system python,

    PYTHONPATH=. python3 -m tools.gpustage run --plan gpu-carry/plan.json --minutes 8

(`--minutes` shrinks to what `--budget` 15 device minutes leave after ~2 to start, ~0.5 per transfer
call and 1 for the results and a margin: each piece costs about half a minute of training; these are
estimates, so before the last call the device's status sets it: the minutes left less 1, at most 9).
After another check in the same session, with the machine still warm, give `--budget` the minutes
left plus the 2 of a start, and pack less: `--budget 11 --hours speech_train=1 --hours noise_train=2
--hours music_train=0.75` packs 128 MiB in 6 pieces and leaves 5.5 minutes for the run (2.2 minutes
on the 2-core EPYC Zen 4).

It checks every piece (a missing or damaged one stops it at once, naming the call to repeat), joins
and checks the tar, unpacks it, installs the wheels into `.gpu/site`, checks the imports and the
init, runs `fit --shards --init --precision bf16 --data-workers cores-2 --max-minutes` (the budget
left less `--reserve`; SIGTERM, on which fit saves and stops, 20 s before the end; a cosine schedule
without `--total-steps` decays over `SCHEDULE_SHARE` of those minutes, `--total-minutes`, so it ends
at `--final-lr` however fast the card steps), averages the last 3 checkpoints as float16 and leaves
in $OUT, on failure too: gpustage.pt, metrics.csv, train.json, nvidia-smi.txt (the card, then a
row every 15 s), gpustage.log and summary.json (status, error, timings, steps, throughput). A second
`run` resumes the run (fit's default) and its schedule.

The fit flags after `--` replace the stage's recipe (`FIT`: the shipped model's GPU-stage recipe, docs/training-log.md). Without them
the segments follow the init's attention window: a third of each segment's frames see the whole
window, as in the CPU stage (`training.loop.full_window_seconds`; 6.1 s for the shipped model's 256
frames, 4 s for 128 or less), and the batch keeps 512 s of audio per step (84 x 6.1 s; 128 x 4 s).
Flags whose segments are shorter than that get a warning at `prepare`, before any device time.

Checked on the CPU with the device's software (Python 3.12, torch 2.11.0+cu130, numpy 2.5.2, and
none of the wheels piece-00 carries): the calls of today's 11-piece plan made locally in order, then
`run --minutes 4` joined and unpacked the pack (1.2 s), passed the preflight and fit 6 steps of 84 x
6.1 s on the 2-core AMD EPYC family 26 model 2 (Zen 5), averaged them and left every output, status ok;
with `-- --data-workers 2 --batch-size 16` (the forked feeder, as on the device) 58 steps at 32
audio-s/s, `data_wait_share` 0.00004.

Expected (docs/training-log.md; batch 128 of 4 s with a 128-frame window, bf16, 14 mixing
processes): one arm alone 2,990 audio-s/s on an H100 (phase 15; 2,900-3,670 per row) and 2,989 on an
H200 (phase 17); two arms side by side 2,270-2,460 each on an H200 (phase 20: 8 minutes, ~2,220
steps each), ~2,060-2,100 each on an H100 (phase 18). Those runs' trainer received every batch
through the pool's pipes, 125-224 ms of its CPU per batch on the 2-core EPYC; the feeder now writes
into shared memory (0.6-3.8 ms), so a run should step faster, up to the model step alone (6,700
audio-s/s at bf16 on an H100, 2 s segments; longer segments cost more per second of audio, as the
training forward computes the whole T x T attention: `enhancer-train bench-fit --init models/tim.pt
--precision bf16 --threads 2` on a 2-core AMD EPYC family 26 model 2 (Zen 5) gave 59 audio-s/s at 16
x 4 s, 34 at 10 x 6.4 s and 28 at 8 x 8 s). So the 7 minutes that 11 pieces leave of the 15 train
~6 minutes: about 0.8-1.1 M audio-s (230-300 h of mixtures); summary.json flags a median under 2,000
on CUDA. Its `fit.result.data_wait_share` is the share of the steps' time spent waiting for batches:
near 1, the mixing bounds the run; near 0, the model step does, and `run ... -- --compile` doubles
it (13,000 audio-s/s compiled on an H100) for a compilation in the first step (`fit --compile --init
models/tim.pt`, batch 2 of 2 s, bf16, on the 2-core EPYC: 89 s, then it ran).
Then, on the CPU (the shipped model's last-stage recipe), the unseen dev set deciding:

    OMP_NUM_THREADS=2 enhancer-train fit --data ../enhancer-data --out ../runs/gA --init gpustage.pt \\
        --augment --snr -5 25 --loss-floor 1e-2 --compressed-weight 20 --sisdr-weight 0.01 \\
        --overestimate-weight 2 --pesq-weight 2 --lr 2e-5 --schedule cosine --warmup-steps 50 \\
        --total-steps 100000 --final-lr 2e-5 --batch-size 5 --segment-seconds 6.4 --precision bf16 \\
        --threads 2 --seed 44 --checkpoint-minutes 6 --keep-last 40 --valid-every 0 --max-minutes 100
    enhancer-train average $(ls ../runs/gA/checkpoints/step-*.pt | tail -n +2) -o cand.pt
    # exported as the shipped graph is (models/MODEL_CARD.md): post-filters from the checkpoint's config,
    # rings calibrated on validation mixtures (CALIB: enhancer-train devset --data ../enhancer-data
    # --out CALIB -n 40 --real-pairs '')
    enhancer export cand.pt -o cand-float.onnx --fp16 --save-checkpoint cand-half.pt
    enhancer export cand-half.pt -o cand.onnx --fp16 --int8 --int8-rings --calibrate CALIB/noisy
    D=../enhancer-devset-unseen   # the shipped model's report: the same eval of models/tim.onnx
    enhancer-train eval --model cand.onnx --noisy $D/noisy --clean $D/clean --out ../runs/eval-cand --jobs 2
    enhancer-train compare --reference ../runs/eval-tim --candidate ../runs/eval-cand
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
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
# a cosine without --total-steps decays over this share of fit's minutes (--total-minutes): the
# rest goes to loading the shards, forking the workers and the checkpoints
SCHEDULE_SHARE = 0.9
START_MIN, CALL_MIN, END_MIN = 2.0, 0.5, 1.0  # device minutes: a start, each transfer call, the results and a margin
HOURS = ("speech_train=2", "music_train=1.5", "speech_valid=0.03", "noise_valid=0.03", "music_valid=0.03")
OUTPUTS = ("gpustage.pt", "metrics.csv", "train.json", "nvidia-smi.txt", "gpustage.log", "summary.json")
EXPECTED = {"audio_s_per_s_one_arm": [2300, 3700], "below": 2000}
PREFLIGHT = ("import json, torch, soundfile, soxr, training.cli\nfrom enhancer import load_checkpoint\n"
             "c = torch.cuda.is_available(); i = %r; i and load_checkpoint(i)\n"
             "print(json.dumps({'torch': torch.__version__, 'cuda': c, 'gpu': c and torch.cuda.get_device_name()}))")


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


def _env(site: Path | None = None) -> dict:
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
        subprocess.run(cmd, check=True, env=_env())
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


def extract_pack(t: tarfile.TarFile, dest: Path) -> None:
    """Unpack the joined tar: plain files and folders inside `dest`, nothing else (links, devices,
    absolute or `..` paths stop it before anything is written). Python 3.10.12 / 3.11.4 and later
    check the same again with tarfile's "data" filter; Debian 12's 3.11.2 has no filters."""
    for m in t.getmembers():
        if not (m.isfile() or m.isdir()) or m.name.startswith("/") or ".." in Path(m.name).parts:
            raise Failure(f"{m.name}: not a plain file or folder inside the pack")
    if hasattr(tarfile, "data_filter"):
        t.extractall(dest, filter="data")
    else:
        t.extractall(dest)


def _write(f, text: str, stamp: bool = False) -> None:
    f.write(f"[gpustage {time.strftime('%H:%M:%S')}] {text}\n" if stamp else text)
    f.flush()  # subprocesses append to the same file


def _join(plan: dict, land: Path, log) -> Path:
    """Check every piece, join the parts, check the tar, unpack it: -> the shards folder."""
    shards = land / "shards"
    if (shards / ".tar-sha256").is_file() and (shards / ".tar-sha256").read_text() == plan["tar"]["sha256"]:
        _write(log, f"{shards}: already unpacked", True)
        return shards
    for k, p in enumerate(plan["pieces"]):
        for name, digest in p["files"].items():
            f = land / p["name"] / name
            redo = f"repeat call {k + 1}: carry {p['carry']}, then `{plan['calls'][k]['move']}`"
            if not f.is_file():
                raise Failure(f"{f} is missing: {redo}")
            if sha256(f) != digest:
                raise Failure(f"{f}: sha256 differs from the plan (a damaged or partial copy): {redo}")
    tar, h = land / "corpus.tar", hashlib.sha256()
    with open(tar, "wb") as out:
        for k, p in enumerate(plan["pieces"]):
            block = (land / p["name"] / f"part-{k:02d}").read_bytes()
            h.update(block)
            out.write(block)
    if h.hexdigest() != plan["tar"]["sha256"]:
        raise Failure(f"{tar}: the joined tar's sha256 differs from the plan (pieces of another prepare?)")
    shutil.rmtree(land / "unpack", ignore_errors=True)
    shutil.rmtree(shards, ignore_errors=True)
    with tarfile.open(tar) as t:
        extract_pack(t, land / "unpack")
    (land / "unpack" / "shards").rename(shards)
    (shards / ".tar-sha256").write_text(plan["tar"]["sha256"])
    tar.unlink()
    return shards


def _train_rows(metrics: Path) -> list[dict]:
    """The train rows of a run folder's metrics.csv (none for a new run)."""
    import csv

    if not metrics.is_file():
        return []
    with open(metrics, newline="") as f:
        return [r for r in csv.DictReader(f) if r["split"] == "train"]


def _throughput(metrics: Path) -> dict:
    rows = [r for r in _train_rows(metrics) if r["audio_s_per_s"] not in ("", "nan")]
    rates = sorted(float(r["audio_s_per_s"]) for r in rows)
    if not rates:
        return {"rows": 0}
    at = [rates[min(len(rates) - 1, int(q * len(rates)))] for q in (0.5, 0.05, 0.95)]
    return {"rows": len(rates), "median": at[0], "p5": at[1], "p95": at[2],
            "overall": len(rates) / sum(1.0 / r for r in rates), "last_step": int(rows[-1]["step"])}


def _trained_minutes(metrics: Path) -> float:
    """Minutes of training steps a run folder's metrics record (0 for a new run)."""
    rows = _train_rows(metrics)
    return 60.0 * float(rows[-1]["hours"]) if rows else 0.0


def _sub(cmd: list, site: Path | None, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *cmd], env=_env(site), capture_output=True, text=True,
                          timeout=max(5.0, timeout), check=False)


def _fit(cmd: list, site: Path, out: Path, log, left) -> tuple[int, str]:
    """Run fit until it stops, or until 20 s before the deadline: then SIGTERM (it saves and stops), and
    5 s before it SIGKILL to its process group."""
    with open(out / "fit.out", "w+") as fout:
        proc = subprocess.Popen([sys.executable, *cmd], stdout=fout, stderr=log, env=_env(site), start_new_session=True)
        try:
            proc.wait(timeout=max(1.0, left() - 20.0))
        except subprocess.TimeoutExpired:
            _write(log, "fit still running near the deadline: SIGTERM", True)
            proc.send_signal(signal.SIGTERM)  # the trainer alone: it stops its mixing processes itself
            try:
                proc.wait(timeout=max(1.0, left() - 5.0))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        fout.seek(0)
        text = fout.read()
    (out / "fit.out").unlink()
    _write(log, text)
    return proc.returncode, text


def run(a, extra: list[str]) -> int:
    t0 = time.monotonic()
    deadline = t0 + 60.0 * a.minutes
    out = Path(a.out or os.environ.get("OUT") or "gpustage-out")
    out.mkdir(parents=True, exist_ok=True)
    summary = {"status": "failed", "error": None, "minutes": a.minutes, "timings_s": {}, "stage": "plan"}
    marks = [t0]

    def left() -> float:
        return deadline - time.monotonic()

    def stage(name: str) -> None:
        summary["timings_s"][summary["stage"]] = round(time.monotonic() - marks[-1], 1)
        summary["stage"] = name
        marks.append(time.monotonic())
        _write(log, f"{name} ({left():.0f} s left)", True)

    sampler = None
    with open(out / "gpustage.log", "a") as log, open(out / "nvidia-smi.txt", "a") as smi:
        try:
            plan = json.loads(Path(a.plan).read_text())
            land = Path(plan["land"])
            stage("pieces")
            shards, site = _join(plan, land, log), land / "site"
            for w in sorted((land / "piece-00" / "wheels").glob("*.whl")):
                with zipfile.ZipFile(w) as z:
                    z.extractall(site)
            init = plan["init"] and str(land / plan["init"] if plan["init"].startswith("piece-00/") else plan["init"])
            stage("preflight")
            r = _sub(["-c", PREFLIGHT % (init or "")], site, min(120.0, left()))
            _write(log, r.stderr)
            if r.returncode:
                raise Failure(f"the device's python cannot run the stage (wheels missing?): {r.stderr[-800:]}")
            device = summary["device"] = json.loads(r.stdout.strip().splitlines()[-1])
            if shutil.which("nvidia-smi"):
                _write(smi, subprocess.run(["nvidia-smi"], capture_output=True, text=True, check=False).stdout)
                sampler = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,utilization.gpu,memory.used,power.draw",
                                            "--format=csv", "-l", "15"], stdout=smi, stderr=subprocess.DEVNULL)
            else:
                _write(smi, "no nvidia-smi on this machine\n")
            stage("fit")
            flags, run_dir = plan["fit"] + extra, land / "run"
            fit_minutes = round(max(0.05, (left() - 60.0 * min(a.reserve, a.minutes / 4)) / 60.0), 2)
            cmd = ["-m", "training.cli", "fit", "--shards", str(shards), "--out", str(run_dir)]
            cmd += ["--init", init] if init and not any(run_dir.glob("checkpoints/step-*.pt")) else []
            workers = max(0, (os.cpu_count() or 2) - 2) if device["cuda"] else 0
            defaults = {"--precision": "bf16", "--checkpoint-minutes": f"{max(0.05, fit_minutes / 5):.2f}",
                        "--keep-last": "6", "--data-workers": str(workers)}
            cmd += [x for k, v in defaults.items() if k not in flags for x in (k, v)]
            cmd += [*flags, "--max-minutes", f"{fit_minutes:.2f}"]
            if "cosine" in flags and "--total-steps" not in flags and "--total-minutes" not in flags:
                trained = _trained_minutes(run_dir / "metrics.csv")  # a resumed run's schedule goes on
                cmd += ["--total-minutes", f"{trained + SCHEDULE_SHARE * fit_minutes:.3f}"]
            _write(log, "python " + " ".join(cmd), True)
            rc, text = _fit(cmd, site, out, log, left)
            results = [ln for ln in text.splitlines() if ln.startswith("{")]
            summary["fit"] = {"command": cmd[2:], "returncode": rc, "result": json.loads(results[-1]) if results else None}
            for name in ("metrics.csv", "train.json"):
                if (run_dir / name).is_file():
                    shutil.copy(run_dir / name, out / name)
            if (run_dir / "metrics.csv").is_file():
                tp = summary["throughput"] = _throughput(run_dir / "metrics.csv")
                summary["below_expected"] = bool(device["cuda"] and tp.get("median", 0) < EXPECTED["below"])
            ckpts = sorted(run_dir.glob("checkpoints/step-*.pt"))[-3:]
            if not ckpts:
                raise Failure(f"fit left no checkpoint (exit {rc}); see gpustage.log")
            stage("average")
            summary["checkpoints_averaged"] = [c.name for c in ckpts]
            twice = ckpts * (2 if len(ckpts) == 1 else 1)  # average needs two: one, twice, is itself as float16
            r = _sub(["-m", "training.cli", "average", *map(str, twice), "-o", str(out / "gpustage.pt"), "--half"],
                     site, left())
            _write(log, r.stdout + r.stderr)
            if r.returncode:
                raise Failure(f"average failed: {r.stderr[-800:]}")
            summary["checkpoint_sha256"] = sha256(out / "gpustage.pt")
            # a SIGTERM that reached fit after it had stopped and printed its result (while its process
            # exited) lost nothing; any other end leaves the run partial
            finished = rc == 0 or (rc == -signal.SIGTERM and bool(results))
            summary["status"] = "ok" if finished else "partial"
            stage("done")
        except Exception as e:  # whatever it was, the summary and the log say so
            summary["error"] = str(e) if isinstance(e, Failure) else f"{type(e).__name__}: {e}"
            _write(log, f"FAILED at {summary['stage']}: {summary['error']}", True)
        finally:
            if sampler is not None:
                sampler.terminate()
                sampler.wait()
    summary["wall_s"] = round(time.monotonic() - t0, 1)
    summary["outputs"] = sorted({p.name for p in out.iterdir()} | {"summary.json"})
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    tail = (out / "gpustage.log").read_text(errors="replace").splitlines()[-40:]
    print("\n".join(tail) + "\n" + json.dumps(summary))
    return 0 if summary["status"] == "ok" else 1


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    argv, extra = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(prog="python -m tools.gpustage", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    q = sub.add_parser("prepare", help="pack, tar and split the corpus into pieces; write plan.json and the calls")
    q.add_argument("--data", type=Path, help="corpus root (as for fit --data)")
    q.add_argument("--staging", type=Path, help="an `enhancer-train pack` folder to carry instead of packing --data")
    q.add_argument("--out", type=Path, default=Path("gpu-carry"))
    q.add_argument("--hours", action="append", metavar="SET=H", help=f"pack --max-hours of a set, in place of its default ({' '.join(HOURS)}); repeatable")
    q.add_argument("--piece-mb", type=float, help="MiB per piece (default: 64 less the tree less 4, at most 60)")
    q.add_argument("--init", default="models/tim.pt", help="starting checkpoint ('' for none)")
    q.add_argument("--wheels", type=Path, help="a folder of cp312 wheels to carry instead of downloading them")
    q.add_argument("--no-wheels", action="store_true", help="carry no wheels (the device has soundfile and soxr)")
    q.add_argument("--minutes", type=float, default=8.0, help="the device run's budget, written into the last call")
    q.add_argument("--budget", type=float, default=15.0, help="device minutes in all: --minutes shrinks to fit it")
    q.add_argument("--cache-dir", type=Path)
    r = sub.add_parser("run", help="on the device: join, check, fit, average; results in $OUT")
    r.add_argument("--plan", type=Path, required=True)
    r.add_argument("--minutes", type=float, default=8.0, help="wall-clock budget of the whole run")
    r.add_argument("--reserve", type=float, default=1.0, help="minutes kept from fit for decoding and averaging")
    r.add_argument("--out", type=Path, help="default: $OUT")
    a = p.parse_args(argv)
    if a.command == "prepare":
        if not (a.data or a.staging):
            p.error("prepare needs --data or --staging")
        try:
            return prepare(a, extra)
        except (Failure, subprocess.CalledProcessError) as e:
            print(f"gpustage prepare: error: {e}", file=sys.stderr)
            return 2
    return run(a, extra)


if __name__ == "__main__":
    sys.exit(main())
