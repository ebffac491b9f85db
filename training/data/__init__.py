"""Training data: what the corpus holds and how examples are made from it.

    `manifests` (file lists), `layouts` (corpus / DNS-Challenge / Voicebank+DEMAND folders),
    `holdout` (sources kept out of training whole), `audio_cache` (decode and resample once;
    `read16k` for scoring), `shards` (the corpus packed for a machine without it, `pack`),
    `synth_noise` (generated noise for the quickstart), `mixing` (one noisy/clean example),
    `augment` (reverb, EQ, speed, band limits, clipping, procedural noise), `synthesis` (the seeded
    example streams, `MixConfig` and the fixed validation set), `feeder` (batches made ahead by
    worker processes).

Nothing here imports the losses, the evaluation or the training loop.
"""
