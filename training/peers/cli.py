"""`enhancer-train bench-peers`: this product's model next to the denoisers a user would otherwise pick.

    enhancer-train bench-peers --noisy DIR --clean DIR [--out DIR] [--model PATH] [--peers a,b,c] [--jobs N]
                               [--dnsmos DIR | --no-dnsmos]

Runs "noisy" (the unprocessed input, the reference row), "tim-enhancer" (default model
`models/tim.onnx`) and every peer of `adapters.PEERS` that is installed (`pip install
.[bench]`, or `make bench-peers`) on the same files, scores all of them with one scorer
(`score.score`: PESQ-WB, STOI, ESTOI, SI-SDR, the speech level, and DNSMOS SIG / BAK / OVRL) and writes `per_file.csv`, `summary.json` and `summary.md` to `--out`.
Peers that are not installed, fail to load or fail on a file are reported, never fatal.

    enhancer-train bench-peers --list                       which peers can run here
    enhancer-train bench-peers --measure-delays --clean DIR  each peer's delay, measured on clean speech
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from ..data.layouts import audio_files
from ..data.manifests import DataError
from ..defaults import default_dnsmos_dir
from .adapters import PEERS, TimEnhancer, make_peer, single_thread
from .align import measure_delay
from .pairs import SNR_PATTERN, find_pairs
from .report import write_reports
from .run import PeerSpec, read_mono, run_benchmark

DEFAULT_OUT = Path("runs/bench-peers")


def add_bench_peers(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench-peers", help="score the model next to peer denoisers on the same files",
        description="Side-by-side quality benchmark: tim-enhancer and peer denoisers (RNNoise, WebRTC NS, Speex, "
                    "NSNet2, DTLN, GTCRN, DeepFilterNet3, noisereduce) on the same noisy/clean pairs, one scorer "
                    "(PESQ-WB, STOI, ESTOI, SI-SDR and the speech level at 16 kHz, and DNSMOS P.835 SIG / BAK / OVRL). Peers come from "
                    "`pip install .[bench]`.")
    p.add_argument("--noisy", type=Path, help="folder of noisy files")
    p.add_argument("--clean", type=Path, help="folder of clean references (same relative paths or names)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"report folder (default {DEFAULT_OUT})")
    p.add_argument("--model", type=Path, help="tim-enhancer ONNX model (default: the shipped models/tim.onnx)")
    p.add_argument("--model-label", help="name of the tim-enhancer row (default tim-enhancer)")
    p.add_argument("--peers", help=f"comma-separated subset of: {', '.join(PEERS)} (default: all; noisy always runs); "
                                   "module:Class adds an adapter of one's own (a training.peers.adapters.Peer)")
    p.add_argument("--jobs", type=int, default=1, help="peers run at once, one process and CPU thread each (default 1)")
    p.add_argument("--snr-regex", default=SNR_PATTERN, help=f"SNR in file names, first group in dB (default {SNR_PATTERN!r})")
    p.add_argument("--manifest", type=Path, help="CSV/TSV/JSONL with 'snr' and a file column (overrides names)")
    p.add_argument("--dnsmos", type=Path, help="DNSMOS model folder (default: ../shared/data/dnsmos if present)")
    p.add_argument("--no-dnsmos", action="store_true", help="skip DNSMOS (intrusive metrics only)")
    p.add_argument("--save-audio", action="store_true", help="also write each peer's output to OUT/audio/PEER/")
    p.add_argument("--list", action="store_true", help="list the peers and whether each can run, then exit")
    p.add_argument("--measure-delays", action="store_true",
                   help="measure each peer's delay on the --clean files and compare with the one it removes")
    p.set_defaults(func=cmd_bench_peers)
    return p


def peer_names(arg: str | None) -> list[str]:
    """--peers -> names in run order, "noisy" first."""
    names = list(PEERS) if not arg else [n.strip() for n in arg.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS and ":" not in n]
    if unknown:
        raise DataError(f"--peers: unknown {', '.join(unknown)}; choose from {', '.join(PEERS)}, or module:Class")
    return ["noisy"] + [n for n in dict.fromkeys(names) if n != "noisy"]


def dnsmos_for(args) -> str | None:
    """The DNSMOS folder to score with: --dnsmos, else the default beside the checkout; None with --no-dnsmos."""
    if getattr(args, "no_dnsmos", False):
        return None
    folder = getattr(args, "dnsmos", None)
    if folder is not None and not Path(folder).is_dir():
        raise DataError(f"--dnsmos: folder not found: {folder}")
    folder = folder or default_dnsmos_dir()
    return None if folder is None else str(folder)


def specs_for(args, dnsmos: str | None = None) -> list[PeerSpec]:
    model = str(args.model) if args.model else None
    return [PeerSpec(n, model, args.model_label, dnsmos) if n == TimEnhancer.name else PeerSpec(n, dnsmos=dnsmos)
            for n in peer_names(args.peers)]


def cmd_list(args) -> int:
    for s in specs_for(args):
        peer = make_peer(s.name, s.model, s.label)
        reason = peer.missing()
        state = reason or f"available {peer.version()}".strip()
        print(f"{peer.name:16s} {peer.rate // 1000:>2d} kHz  {state}")
    return 0


def cmd_measure_delays(args) -> int:
    if not args.clean:
        raise DataError("--measure-delays needs --clean DIR (clean speech)")
    files = audio_files(args.clean)[:3] if args.clean.is_dir() else []
    if not files:
        raise DataError(f"no audio files in {args.clean}")
    single_thread()
    mismatches = 0
    print(f"{'peer':16s} {'rate':>6s} {'removed':>8s} {'measured':>9s}  per file")
    for s in specs_for(args):
        peer = make_peer(s.name, s.model, s.label)
        if s.name in ("noisy", TimEnhancer.name):
            continue
        if peer.missing():
            print(f"{peer.name:16s} {peer.missing()}")
            continue
        try:
            peer.ensure_loaded()
            found = [measure_delay(peer, *read_mono(str(f))) for f in files]
        except Exception as e:  # a broken peer is reported
            print(f"{peer.name:16s} failed: {type(e).__name__}: {e}")
            continue
        measured = sorted(found)[len(found) // 2]
        mismatches += abs(measured - peer.delay) > peer.rate // 4000  # 0.25 ms: nonlinear peers wobble
        print(f"{peer.name:16s} {peer.rate:6d} {peer.delay:8d} {measured:9d}  {found}")
    return 1 if mismatches else 0


def cmd_bench_peers(args) -> int:
    if args.list:
        return cmd_list(args)
    if args.measure_delays:
        return cmd_measure_delays(args)
    if not args.noisy or not args.clean:
        raise DataError("bench-peers needs --noisy DIR and --clean DIR")
    if args.jobs < 1:
        raise DataError(f"--jobs must be >= 1, got {args.jobs}")
    pairs = find_pairs(args.noisy, args.clean, args.snr_regex, args.manifest)
    dnsmos = dnsmos_for(args)
    specs = specs_for(args, dnsmos)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    log(f"bench-peers: {len(pairs)} pair(s), peers: {', '.join(s.name for s in specs)}"
        + ("" if dnsmos else " (no DNSMOS: intrusive metrics only)"))
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    save = args.out / "audio" if args.save_audio else None
    results = run_benchmark(pairs, specs, jobs=args.jobs, save_dir=save, log=log)
    meta = {"noisy": str(args.noisy), "clean": str(args.clean), "dnsmos": dnsmos, "wall_seconds": time.perf_counter() - t0,
            "cpus": os.cpu_count(), "load_average": [load0, os.getloadavg()[0]]}
    paths = write_reports(results, args.out, meta)
    print(paths["md"].read_text())
    log(f"bench-peers: wrote {', '.join(str(p) for p in paths.values())}")
    return 0


def main(argv=None) -> int:
    """Stand-alone entry (`python -m training.peers ...`, see `__main__`), the same as `enhancer-train bench-peers`."""
    parser = argparse.ArgumentParser(prog="bench-peers")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_peers(sub)
    args = parser.parse_args(["bench-peers", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except (DataError, ValueError, FileNotFoundError) as e:
        print(f"bench-peers: error: {e}", file=sys.stderr)
        return 2

