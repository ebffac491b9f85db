"""Scoring and reports: `metrics` (PESQ-WB, STOI, ESTOI, SI-SDR and the labels of every report),
`dnsmos`, `evaluate` (`enhancer-train eval`), `devnames` (dev-set file names), `devset` (building
the dev sets), `devscore` (dev-set scoring during training), `plots`, `competition`, `ablation`."""
