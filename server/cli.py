"""`enhancer serve`: the service's sub-command of the `enhancer` command line.

The core package does not know the service: it finds this command through the entry point group
`enhancer.commands` (pyproject.toml), whose entries each add one sub-command to the parser.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from enhancer.devices import DEVICES


def add_serve(sub) -> argparse.ArgumentParser:
    """Add `serve` to the `enhancer` command's sub-parsers (`sub`)."""
    s = sub.add_parser("serve", help="run the REST + websocket service")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    s.add_argument("--model", default=None, help="exported .onnx model (default: the shipped one)")
    s.add_argument("--device", choices=DEVICES, default="auto", help="where to run the model (auto: CUDA when "
                   "this onnxruntime has it, else CPU; cuda: refuse to start without it)")
    s.add_argument("--workers", type=int, default=None, help="inference worker threads, each with its own lane "
                   "pool on one shared onnxruntime session (default: one per CPU this process may use, from "
                   "its affinity and cgroup CPU quota; 1 with --device cuda)")
    s.add_argument("--max-streams", type=int, default=64, help="upper bound of live streams (the measured capacity "
                   "admits at most this many)")
    s.add_argument("--capacity", type=int, default=None, help="admit this many live streams instead of measuring "
                   "the capacity at start-up")
    s.add_argument("--capacity-margin", type=float, default=None, help="share of the 16 ms hop the step (its median "
                   "times the tail factor p95 / median) must leave free when measuring the capacity (default 0.3)")
    s.add_argument("--loop-ms", type=float, default=None, help="the event loop's CPU per live stream and hop, "
                   "reproduced while measuring the capacity (default 0.2; /readyz shows the figure measured while "
                   "serving as loop_ms_per_stream)")
    s.add_argument("--max-batch-wait-ms", type=float, default=None, help="longest wait of a ready hop for the other "
                   "live streams to join its step, 0-16 (default 12; 4 suits a GPU, whose step costs about the same "
                   "for 1 stream and for 1,000)")
    s.add_argument("--drain-timeout-s", type=float, default=None, help="on SIGTERM, how long live streams run on "
                   "before they get their tail and close 1012 (default: $TIM_ENHANCER_DRAIN_TIMEOUT_S, else 10)")
    s.add_argument("--agent-port", type=int, default=None, help="TCP port of the HAProxy agent-check (free "
                   "capacity as a weight; default: $TIM_ENHANCER_AGENT_PORT, else none)")
    s.add_argument("--api-key", default=None, help="require this key (default: $TIM_ENHANCER_API_KEY if set)")
    s.add_argument("--api-keys", default=None, metavar="FILE", help="TOML or JSON file of named keys, each with its "
                   "own limits; re-read on SIGHUP and POST /v1/admin/reload (default: $TIM_ENHANCER_API_KEYS_FILE; "
                   "server/README.md, API keys)")
    s.add_argument("--ssl-certfile", default=None, metavar="PEM", help="serve https and wss with this certificate "
                   "(chain first); needs --ssl-keyfile")
    s.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="the certificate's private key")
    s.add_argument("--step-server", default=None, metavar="ADDRESS", help="run the model in the step server at this "
                   "Unix socket (`enhancer step-server`), shared with other serve processes: one GPU for several "
                   "front-ends (server/README.md, Serving on a GPU)")
    s.add_argument("--step-key-file", default=None, metavar="PATH", help="file holding the key shared with the "
                   "step server (its trailing newline stripped; default: $TIM_ENHANCER_STEP_KEY); required with "
                   "--step-server")
    s.add_argument("--full-steps", action=argparse.BooleanOptionalAction, default=None, help="on a device pool, "
                   "each round's live step covers the whole pool through one static graph (a CUDA graph under CUDA; "
                   "default: $TIM_ENHANCER_FULL_STEPS=1)")
    s.add_argument("--device-pool", action=argparse.BooleanOptionalAction, default=None, help="keep the streams' "
                   "state in a device pool on the CPU too (always under CUDA; default: $TIM_ENHANCER_DEVICE_POOL=1)")
    s.set_defaults(fn=cmd_serve)
    return s


def cmd_serve(a) -> int:
    from enhancer.errors import EnhancerError
    from server import run

    step_key = read_key(a.step_key_file, "--step-key-file") if a.step_key_file else None
    try:
        run(host=a.host, port=a.port, model=a.model, device=a.device, workers=a.workers, max_streams=a.max_streams,
            api_key=a.api_key, capacity=a.capacity, capacity_margin=a.capacity_margin, loop_ms=a.loop_ms,
            drain_timeout_s=a.drain_timeout_s, agent_port=a.agent_port, step_server=a.step_server,
            max_batch_wait_ms=a.max_batch_wait_ms, step_key=step_key, full_steps=bool(a.full_steps),
            device_pool=bool(a.device_pool), api_keys_file=a.api_keys, ssl_certfile=a.ssl_certfile,
            ssl_keyfile=a.ssl_keyfile)
    except ModuleNotFoundError as e:  # installed without the [serve] extra
        raise EnhancerError(f"`enhancer serve` needs the service's dependencies: pip install "
                            f"'tim-enhancer[cpu,serve]' ({e})") from None
    return 0


def add_step_server(sub) -> argparse.ArgumentParser:
    """Add `step-server` to the `enhancer` command's sub-parsers: the process that runs the model for
    several `enhancer serve --step-server` processes (server.stepserver)."""
    from server.stepserver import add_arguments

    s = sub.add_parser("step-server", help="run the model for several serve processes (one GPU, many front-ends)")
    add_arguments(s, DEVICES)
    s.set_defaults(fn=cmd_step_server)
    return s


def cmd_step_server(a) -> int:
    from server.stepserver import run

    return run(a, read_key(a.key_file, "--key-file"))


def read_key(path: str | None, flag: str) -> str | None:
    """The key a step server shares with its front-ends: the text of the file at `path` (given
    with `flag`) without its trailing newline, else $TIM_ENHANCER_STEP_KEY, else None."""
    from enhancer.errors import EnhancerError
    from server.settings import STEP_KEY_ENV

    if not path:
        return os.environ.get(STEP_KEY_ENV) or None
    try:
        key = Path(path).read_text().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as e:
        raise EnhancerError(f"{flag} {path}: cannot read the key ({e})") from None
    if not key:
        raise EnhancerError(f"{flag} {path}: the file holds no key")
    return key
