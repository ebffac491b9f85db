"""Training and evaluation of tim-enhancer models (`enhancer-train`, see `training.cli`).

    enhancer-train fit          ...   DNS-style on-the-fly mixing, Adam, checkpoints, torchrun DDP
    enhancer-train eval         ...   PESQ-WB, STOI, ESTOI, SI-SDR, DNSMOS P.835 on paired folders
    enhancer-train plot         ...   spectrograms, competition scores, training curves
    enhancer-train competition  ...   competition scores against speech activity, per TIM layer
    enhancer-train devset       ...   the dev test sets (seen and unseen sources)
    enhancer-train ablation     ...   the ablation table of several runs
    enhancer-train synth-noise  ...   generated noise and its manifest (the quickstart)
    enhancer-train bench-peers  ...   the model beside peer denoisers (training.peers; a source checkout)

Layout (the loop and the commands on top, the sub-packages below them; no sub-package imports the
modules above it):
    data/         `manifests` (file lists), `layouts` (corpus / DNS-Challenge / Voicebank+DEMAND
                  folders), `holdout` (sources kept out of training whole), `audio_cache` (decode and
                  resample once; `read16k` for scoring), `shards` (`pack`), `synth_noise`, `mixing`
                  (one noisy/clean example), `augment`, `synthesis` (example streams, `MixConfig`,
                  the fixed validation set), `feeder` (batches made ahead by worker processes)
    losses/       `objective` (the loss, `LossConfig`), `perceptual` (the P.862 disturbance term)
    evaluation/   `metrics` (PESQ-WB, STOI, ESTOI, SI-SDR and the labels of every report), `dnsmos`,
                  `evaluate`, `devnames`, `devset`, `devscore` (dev-set scoring during training),
                  `plots`, `competition`, `ablation`
    peers/        the side-by-side benchmark (not installed with the package)
    training      `options` (`FitOptions` and the flags of `fit`), `fit` (the command), `loop` (the
                  trainer), `prepare` (its settings, data, model and dev scorer), `resume`,
                  `runfolder` (config.json, train.json, metrics.csv), `checkpoints`, `precision`,
                  `distributed`, `progress`, `benchfit`, `average`
    wiring        `cli` (sub-commands only), `defaults` (paths beside the checkout)
"""
