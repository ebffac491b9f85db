"""`enhancer stream IN -o OUT --url URL`: a file streamed through the service's websocket as a live
source would send it (`enhancer.client`), the enhanced audio written as it comes back.

Errors are one line on stderr and a non-zero exit, no traceback (`enhancer.cli.main`): a file the
command line would refuse (`enhancer denoise`'s messages), a service that cannot be reached, or
what the service refused (`error: <its message> (<kind>)`).
"""
from __future__ import annotations

import argparse
import sys

from .client import DEFAULT_URL


def add_stream(sub) -> argparse.ArgumentParser:
    """Add `stream` to the `enhancer` command's sub-parsers (`sub`)."""
    from .audio_io import OUTPUT_FORMATS

    s = sub.add_parser("stream", help="stream a file through the service's websocket, as a live source",
                       description="Stream an audio file through the service's websocket /v1/stream at real-time "
                                   "pace (or --fast) and write the enhanced audio: the same rate, channels and "
                                   "length. It waits when the service is full (close 1013), and when it restarts "
                                   "(close 1012) it continues the stream on the next replica from the state the "
                                   "service hands over, as if it had not stopped.")
    s.add_argument("input", help="audio file (any format libsndfile reads)")
    s.add_argument("-o", "--output", required=True, help="output file; its extension picks the format "
                   f"({', '.join('.' + k for k in OUTPUT_FORMATS)} or the input's own)")
    s.add_argument("--url", default=DEFAULT_URL, help=f"the service (default {DEFAULT_URL}; ws://HOST:PORT/v1/stream "
                   "works too)")
    s.add_argument("--api-key", default=None, help="the service's API key, when it wants one")
    s.add_argument("--atten-lim-db", type=float, default=None, help="limit noise attenuation to this many dB")
    s.add_argument("--band", choices=["full", "speech"], default=None,
                   help="above 16 kHz: full (the service's default) keeps the band above 8 kHz; speech does not")
    s.add_argument("--level", choices=["model", "input"], default=None, help="model (default): the model's "
                   "output level; input: the voice given back at the input's speech level")
    s.add_argument("--format", choices=list(OUTPUT_FORMATS), default=None, help="output container (default: from "
                   "the output's extension)")
    pace = s.add_mutually_exclusive_group()
    pace.add_argument("--fast", action="store_true", help="send as fast as the service takes it, not in real time")
    pace.add_argument("--speed", type=float, default=1.0, help="times real time (default 1: a microphone's pace)")
    s.add_argument("-q", "--quiet", action="store_true", help="no summary and no notices on stderr (errors still)")
    s.set_defaults(fn=cmd_stream)
    return s


def cmd_stream(a) -> int:
    import asyncio

    from .client import Client

    if not a.fast and not a.speed > 0:
        print("error: --speed must be > 0 (or --fast)", file=sys.stderr)
        return 2
    client = Client(a.url, a.api_key)

    def notice(msg: dict) -> None:
        line = None if a.quiet else notice_line(msg)
        if line is not None:
            print(line, file=sys.stderr)

    facts = asyncio.run(client.stream_file(a.input, a.output, speed=0 if a.fast else a.speed, format=a.format,
                                           on_message=notice, atten_lim_db=a.atten_lim_db, band=a.band, level=a.level))
    if not a.quiet:
        print(f"{facts['frames'] / facts['sample_rate']:.1f} s enhanced through {client.ws_url} "
              f"({facts['sessions']} connection(s)) to {facts['path']}", file=sys.stderr)
    return 0


def notice_line(msg: dict) -> str | None:
    """The line a person streaming a file reads for one of the service's messages (None: nothing
    to tell)."""
    kind = msg.get("type")
    if kind in ("ready", "metadata", "error") or (kind == "end" and "reason" not in msg):
        return None
    if kind == "state":  # megabytes of base64: what it is, not what it holds
        text = (f"the service restarts; its state of the stream ({len(msg.get('state', '')) * 3 // 4} bytes) goes "
                f"to the next connection, which continues at input sample {msg.get('input_samples')}")
    else:
        text = msg.get("message") or ", ".join(f"{k} {v}" for k, v in msg.items() if k != "type")
    return f"{kind}: {text}"
