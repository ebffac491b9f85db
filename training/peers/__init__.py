"""The side-by-side benchmark of the model and peer denoisers (`enhancer-train bench-peers`,
`python -m training.peers`, `make bench-peers`), run from a source checkout: it is not installed
with the package.

Modules: `cli` (the command), `adapters` (one per denoiser), `align` (resampling and delay
removal), `pairs` (noisy/clean pairs and their SNR), `run` (peers in processes of their own),
`score` (the one scorer), `report` (CSV, JSON and markdown).
"""
