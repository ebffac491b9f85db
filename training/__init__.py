"""Training and evaluation of tim-enhancer models (`enhancer-train`, see `training.cli`).

    enhancer-train fit          ...   DNS-style on-the-fly mixing, Adam, checkpoints, torchrun DDP
    enhancer-train eval         ...   PESQ-WB, STOI, ESTOI, SI-SDR, DNSMOS P.835 on paired folders
    enhancer-train plot         ...   spectrograms, competition scores, training curves
    enhancer-train competition  ...   competition scores against speech activity, per TIM layer
    enhancer-train devset       ...   the dev test sets (seen and unseen sources)
    enhancer-train ablation     ...   the ablation table of several runs
    enhancer-train synth-noise  ...   generated noise and its manifest (the quickstart)
    enhancer-train bench-peers  ...   the model beside peer denoisers (training.peers; a source checkout)

Modules:
    data in     `manifests` (file lists), `layouts` (corpus / DNS-Challenge / Voicebank+DEMAND
                folders), `holdout` (sources kept out of training whole), `audio_cache` (decode and
                resample once; `read16k` for scoring), `synth_noise`
    examples    `mixing` (one noisy/clean example), `augment` (reverb, EQ, speed, band limits,
                clipping, procedural noise), `data` (example streams and the fixed validation set)
    training    `fit` (the command), `loop` (the trainer), `objective` (the loss), `checkpoints`,
                `distributed`, `progress`, `devscore` (dev-set scoring during training)
    scoring     `metrics` (PESQ-WB, STOI, ESTOI, SI-SDR and the labels of every report), `dnsmos`,
                `evaluate`, `devnames` (dev-set file names), `devset`
    reports     `plots`, `competition`, `ablation`
    wiring      `cli` (sub-commands only), `defaults` (paths beside the checkout)
    harness     `peers/` (the side-by-side benchmark; not installed with the package)
"""
