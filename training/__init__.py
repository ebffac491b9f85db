"""Training and evaluation of tim-enhancer models.

    enhancer-train fit   ...   DNS-style on-the-fly mixing, Adam, checkpoints, torchrun DDP
    enhancer-train eval  ...   PESQ-WB, STOI, ESTOI, SI-SDR, DNSMOS P.835 on paired folders
    enhancer-train plot  ...   spectrograms, competition scores, training curves

Modules: `manifests` (file lists), `layouts` (corpus / DNS-Challenge / Voicebank+DEMAND folders),
`audio_cache` (decode and resample once), `mixing` (one noisy/clean example), `data` (example
streams and the fixed validation set), `loop` (the trainer), `checkpoints`, `evaluate`, `metrics`,
`dnsmos`, `plots`, `cli`.
"""
