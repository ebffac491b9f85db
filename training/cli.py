"""`enhancer-train`: the training command line. Also runs as `python -m training.cli` (and under
torchrun). This module only wires the sub-commands; each lives in its own module:

    fit           train a model                                  training.fit (training.loop)
    eval          score a model on paired noisy/clean files      training.evaluation.evaluate
    plot          spectrograms, competition scores, curves       training.evaluation.plots
    competition   do the TIM mechanisms specialise on speech?    training.evaluation.competition
    devset        build the dev test set                         training.evaluation.devset
    bench-peers   the model beside peer denoisers                training.peers (a source checkout)
    ablation      the ablation table of several runs             training.evaluation.ablation
    synth-noise   generated noise and its manifest (quickstart)  training.data.synth_noise
    pack          the corpus as compressed shards (GPU machines)  training.data.shards
    bench-fit     where a training step's time goes               training.benchfit
    average       the mean of several checkpoints (model soup)    training.average
    grow          a wider model with the same output              training.grow
    corpus        rebuild the training corpus from public sources training.data.corpus

    enhancer-train fit --preset tim --data ../enhancer-data --out runs/tim
    enhancer-train eval --model runs/tim/checkpoints/best.pt --noisy DIR --clean DIR --out report/

Paths beside the checkout (`../shared/data`: DNSMOS models, the real dev pairs) are
`training.defaults`, passed to the commands here as the defaults of their flags.
"""
from __future__ import annotations

import argparse
import sys

from enhancer.errors import EnhancerError

from .average import add_average
from .benchfit import add_bench_fit
from .data.corpus import add_corpus
from .data.manifests import DataError
from .data.shards import add_pack
from .data.synth_noise import add_synth_noise
from .defaults import Defaults
from .evaluation.ablation import add_ablation
from .evaluation.competition import add_competition
from .evaluation.decide import add_compare
from .evaluation.devset import add_devset
from .evaluation.evaluate import add_eval
from .evaluation.plots import add_plot
from .fit import add_fit
from .grow import add_grow


def add_bench_peers(sub) -> None:
    """`bench-peers` from training.peers, which runs from a source checkout (not installed with
    the package): elsewhere the command says so."""
    try:
        from .peers.cli import add_bench_peers as add
    except ImportError as e:
        # no option characters: whatever follows is taken as is, to fail with the reason
        p = sub.add_parser("bench-peers", help="(runs from a source checkout)", add_help=False, prefix_chars="\0")
        p.add_argument("args", nargs="*")
        reason = f"bench-peers runs from a source checkout of tim-enhancer (make bench-peers): {e}"

        def unavailable(_args) -> int:
            raise DataError(reason)

        p.set_defaults(func=unavailable)
        return
    add(sub)


def build_parser(defaults: Defaults | None = None) -> argparse.ArgumentParser:
    d = defaults or Defaults.beside_checkout()
    parser = argparse.ArgumentParser(prog="enhancer-train", description="Train and evaluate tim-enhancer models.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_fit(sub, dnsmos_dir=d.dnsmos_dir)
    add_eval(sub, dnsmos_dir=d.dnsmos_dir)
    add_plot(sub)
    add_competition(sub)
    add_devset(sub, real_pairs=d.real_pairs)
    add_bench_peers(sub)
    add_ablation(sub)
    add_compare(sub)
    add_synth_noise(sub)
    add_pack(sub)
    add_bench_fit(sub)
    add_average(sub)
    add_grow(sub)
    add_corpus(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (DataError, EnhancerError, ValueError, FileNotFoundError) as e:
        print(f"enhancer-train {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
