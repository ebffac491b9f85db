"""Test and benchmark tooling for the service, run from a source checkout (not installed with the
package, not in the image):

    python -m tools.loadtest   real-time clients against a server: lateness, latency, capacity
    python -m tools.soak       a long load run with RSS / descriptor sampling and connect cycles
    python -m tools.fuzz       hypothesis uploads and websocket sessions, schemathesis on the API
    python -m tools.audit      known vulnerabilities of the serving dependency closure
    python -m tools.gpu_check  the model and the service under CUDA, measured (make gpu-check)
    python -m tools.gpu_carry  what gpu_check needs on a GPU machine without a package index
    python -m tools.examples   the before/after examples of the page's Examples tab (server/static/examples/)

Helpers: `launch` (a server process on a free loopback port), `rawws` (a websocket client that can
send what no library would), `fuzz_cases` (the fuzzing strategies), `machine_stalls` (whether
the whole machine stalled), `loadtest_clients` (the load generator's clients), `gpu_check_load`
(gpu_check's load-test stages), `gpustage_pack` (gpustage's `prepare`). See server/README.md.
"""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]  # the source checkout these tools run from
