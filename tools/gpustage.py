"""A GPU stage prepared on the CPU: `python -m tools.gpustage prepare` here, `run` on the GPU machine.

The GPU machine takes one bash command per call, each call sending the working tree (`tree_mib`:
tracked and untracked-not-ignored files; the models are tracked, the corpus recipes gzipped for
this) plus a few ignored paths, 64 MiB in all; it has no network and a few minutes of device time.
So `prepare` (`tools.gpustage_pack`) does the slow and fallible steps here:

    python -m tools.gpustage prepare --data ../enhancer-data --out gpu-carry -- <fit flags>

packs the corpus (`enhancer-train pack`: the speech lossless, noise and music as Opus at quality
0.8, 56 kbit/s; by default (`HOURS`) 2 h of the speech, all of the noise and 1.5 h of the music;
`--hours SET=H` caps one set instead of its default), tars it, splits the tar
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
estimates, so before the last call the device's status sets it: the minutes left less 1, at most 9;
`prepare` refuses a plan that leaves less than 3). After another check in the same session, with
the machine still warm, give `--budget` the minutes left plus the 2 of a start, and pack less, e.g.
`--budget 11 --hours speech_train=1 --hours noise_train=2 --hours music_train=0.75`. Sizes and
times of both plans: docs/performance.md, GPU stage.

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

summary.json's `throughput` is the median, 5th and 95th percentiles of fit's audio-seconds per
second over its train rows; on CUDA, `below_expected` flags a median under `EXPECTED["below"]`
(the throughput of past runs, and what a stage trains in its minutes: docs/performance.md, GPU
stage). `fit.result.data_wait_share` is the share of the steps' time spent waiting for batches:
near 1, the mixing bounds the run; near 0, the model step does, and `run ... -- --compile` speeds
that up for a compilation in the first step.
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

from .gpustage_pack import EXPECTED, HOURS, Failure, child_env, prepare

# a cosine without --total-steps decays over this share of fit's minutes (--total-minutes): the
# rest goes to loading the shards, forking the workers and the checkpoints
SCHEDULE_SHARE = 0.9
PREFLIGHT = ("import json, torch, soundfile, soxr, training.cli\nfrom enhancer import load_checkpoint\n"
             "c = torch.cuda.is_available(); i = %r; i and load_checkpoint(i)\n"
             "print(json.dumps({'torch': torch.__version__, 'cuda': c, 'gpu': c and torch.cuda.get_device_name()}))")


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
    return subprocess.run([sys.executable, *cmd], env=child_env(site), capture_output=True, text=True,
                          timeout=max(5.0, timeout), check=False)


def _fit(cmd: list, site: Path, out: Path, log, left) -> tuple[int, str]:
    """Run fit until it stops, or until 20 s before the deadline: then SIGTERM (it saves and stops), and
    5 s before it SIGKILL to its process group."""
    with open(out / "fit.out", "w+") as fout:
        proc = subprocess.Popen([sys.executable, *cmd], stdout=fout, stderr=log, env=child_env(site), start_new_session=True)
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
