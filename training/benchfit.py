"""`enhancer-train bench-fit`: where a training step's time goes on this machine.

Times, for each batch size, the model's training step alone (forward with the objective, backward,
Adam) on inputs already on the device, and separately the mixing of one batch on one CPU core
(`training.data.synthesis.Synthesizer`, from a corpus or a packed copy); prints audio-seconds per second of
each, so the two can be compared (mixing scales with `fit --data-workers`). With `--data-workers N`
it also runs the batch feeder of `fit` (N forked workers, `training.data.feeder`) and prints the
audio-seconds per second it delivers and the trainer's CPU per batch (what is left of the trainer's
core for driving the device).

    enhancer-train bench-fit --init models/tim.pt --batch 32,128,256 --precision bf16
    enhancer-train bench-fit --init models/tim.pt --shards DIR --augment --mixing-batches 2
    enhancer-train bench-fit --batch '' --shards DIR --augment --segment-seconds 4 --data-workers 14
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np


def add_bench_fit(sub) -> None:
    p = sub.add_parser("bench-fit", help="time a training step (model and mixing) on this machine")
    p.add_argument("--init", help="checkpoint whose model is timed (default: a new `tim` model)")
    p.add_argument("--batch", default="16,64,256", help="batch sizes, comma-separated")
    p.add_argument("--segment-seconds", type=float, default=2.0)
    p.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16", "fp16"))
    p.add_argument("--steps", type=int, default=20, help="timed steps per batch size (after 3 warm-up steps)")
    p.add_argument("--compressed-weight", type=float, default=20.0)
    p.add_argument("--sisdr-weight", type=float, default=0.0)
    p.add_argument("--mrstft-weight", type=float, default=0.0)
    p.add_argument("--pesq-weight", type=float, default=0.0)
    p.add_argument("--threads", type=int, help="torch threads (CPU)")
    p.add_argument("--shards", help="also time mixing from this packed corpus (folders A,B,...)")
    p.add_argument("--augment", action="store_true", help="mixing with the augmentation recipe")
    p.add_argument("--mixing-batches", type=int, default=2, help="batches of 16 examples timed for mixing")
    p.add_argument("--data-workers", type=int, default=0,
                   help="also time fit's batch feeder with this many worker processes (with --shards)")
    p.add_argument("--feeder-batch", type=int, default=128, help="the feeder's batch size")
    p.add_argument("--feeder-batches", type=int, default=8, help="batches timed for the feeder")
    p.add_argument("--compile", action="store_true", help="time the torch.compile'd model")
    p.add_argument("--json", type=Path, help="write the figures here too")
    p.set_defaults(func=cmd_bench_fit)


def cmd_bench_fit(args) -> int:
    import torch

    from enhancer import build_model, load_checkpoint

    from .losses.objective import batch_loss
    from .precision import allow_tf32, autocast_for, choose_precision

    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    allow_tf32(dev)
    precision = choose_precision(args.precision, dev)
    model = (load_checkpoint(args.init) if args.init else build_model("tim")).to(dev).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    net = torch.compile(model) if args.compile else model

    def autocast():
        return autocast_for(dev, precision)

    n = int(round(args.segment_seconds * 16000))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    rows = []
    print(f"device {name}, precision {precision}{', compiled' if args.compile else ''}, "
          f"segments of {args.segment_seconds:g} s")
    for b in (int(x) for x in args.batch.split(",") if x):
        g = torch.Generator(device="cpu").manual_seed(b)
        clean = (torch.randn(b, n, generator=g) * 0.05).to(dev)
        noisy = clean + (torch.randn(b, n, generator=g) * 0.05).to(dev)
        bw = torch.full((b,), 8000.0, device=dev)

        def step(noisy=noisy, clean=clean, bw=bw):
            opt.zero_grad(set_to_none=True)
            loss = batch_loss(net, model, noisy, clean, bw, autocast, None, args.compressed_weight,
                              sisdr_weight=args.sisdr_weight, mrstft_weight=args.mrstft_weight,
                              pesq_weight=args.pesq_weight)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()

        for _ in range(3):
            step()
        times = []
        for _ in range(args.steps):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        med = float(np.median(times))
        row = {"batch": b, "step_ms": med * 1e3, "model_audio_s_per_s": b * args.segment_seconds / med}
        if dev.type == "cuda":
            row["max_memory_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
        rows.append(row)
        print(f"batch {b:5d}: step {med * 1e3:8.1f} ms (median of {args.steps}), model {row['model_audio_s_per_s']:8.0f} "
              f"audio-s/s" + (f", {row['max_memory_gib']:.1f} GiB" if "max_memory_gib" in row else ""), flush=True)
    result = {"device": name, "precision": precision, "compiled": args.compile, "model": rows}
    if args.shards:
        from .data.shards import packed_layout
        from .data.synthesis import AUGMENT_RECIPE, MixConfig, Synthesizer

        data = packed_layout([Path(f) for f in args.shards.split(",") if f], log=lambda *_: None)
        a = data.audio
        cfg = MixConfig.from_dict({**(AUGMENT_RECIPE if args.augment else {}), "segment_seconds": args.segment_seconds})
        synth = Synthesizer(a["speech", "train"], a["noise", "train"], a.get(("music", "train")), cfg, seed=1)
        synth.batch(range(16))  # warm-up
        t = time.perf_counter()
        for k in range(args.mixing_batches):
            synth.batch(range(16 * (k + 1), 16 * (k + 2)))
        dt = time.perf_counter() - t
        result["mixing_audio_s_per_s_per_core"] = 16 * args.mixing_batches * args.segment_seconds / dt
        print(f"mixing{' (augment)' if args.augment else ''}: {result['mixing_audio_s_per_s_per_core']:.0f} audio-s/s "
              f"on one core")
        if args.data_workers > 0:
            result["feeder"] = time_feeder(synth, args.feeder_batch, args.data_workers, args.feeder_batches)
            f = result["feeder"]
            print(f"feeder, {f['workers']} worker(s), batch {f['batch']}: {f['audio_s_per_s']:.0f} audio-s/s, "
                  f"trainer CPU {f['trainer_cpu_ms_per_batch']:.1f} ms per batch", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


def time_feeder(synth, batch: int, workers: int, batches: int) -> dict:
    """`fit`'s batch feeder taking `batches` batches as fast as its workers make them: audio-seconds
    per second delivered, and the CPU the trainer's process (all its threads) spent per batch."""
    from .data.feeder import BatchFeeder

    feeder = BatchFeeder(synth, batch, batch, 0, workers)
    try:
        feeder.next()  # the first batch: the forks start and the shared slots are touched
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(batches):
            feeder.next()
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    finally:
        feeder.close()
    return {"workers": workers, "batch": batch, "batches": batches,
            "audio_s_per_s": batch * batches * synth.cfg.segment_seconds / wall,
            "trainer_cpu_ms_per_batch": cpu / batches * 1e3}
