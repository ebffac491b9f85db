"""Fuzz the service on loopback: uploads and websocket sessions from hypothesis strategies
(`fuzz_cases`), and the OpenAPI description with schemathesis.

    python -m tools.fuzz --uploads 10000 --sessions 1000 --schemathesis-seconds 120
    python -m tools.fuzz --uploads 200 --url http://127.0.0.1:8000      # a running server

Without --url it starts a server (a random-weight model unless --model or the shipped one) with
small limits. Every case is checked against an oracle: the server never answers 500 or closes a
stream with 1011 for a client's mistake, every error has the documented JSON form with no
internals, valid input is enhanced completely (200 with the input's rate, channels and length;
websocket close 1000 with as many samples out as in), and the server is alive afterwards.
Hypothesis stops at the first violation and prints the smallest case that shows it.
Requires the `dev` extra (hypothesis, schemathesis).
"""
from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import soundfile as sf

from server.errors import KINDS

from . import REPO_ROOT
from .fuzz_cases import SessionCase, UploadCase, encode_upload, sessions, uploads
from .rawws import OP_BINARY, OP_PING, OP_TEXT, RawClient

INTERNALS = ("Traceback", 'File "', ".py\"", "site-packages", " object at 0x")
# close codes a stream may end with when the client did something wrong (1002/1007/1009 may
# also come from the websocket protocol layer itself)
CLIENT_ERROR_CODES = {1000, 1002, 1003, 1007, 1008, 1009}
LIMITS = dict(max_upload_bytes=2_000_000, max_duration_s=20.0, max_message_bytes=100_000, idle_timeout_s=3.0,
              max_streams=64, capacity=64, max_rest_jobs=8, rest_chunk_s=0.5)  # fixed: no calibration


class Violation(AssertionError):
    """The server broke its contract on a fuzz case."""


class Stats:
    def __init__(self):
        self.uploads = self.sessions = 0
        self.status: dict[int, int] = {}
        self.codes: dict[int, int] = {}
        self.clean_uploads = self.clean_sessions = 0
        self.kinds: dict[str, int] = {}

    def summary(self) -> dict:
        return {"uploads": self.uploads, "clean_uploads": self.clean_uploads, "upload_status": dict(sorted(self.status.items())),
                "error_kinds": dict(sorted(self.kinds.items())), "sessions": self.sessions,
                "clean_sessions": self.clean_sessions,
                "close_codes": {str(k): v for k, v in sorted(self.codes.items(), key=lambda kv: str(kv[0]))}}


def check_error_body(text: str, where: str) -> dict:
    for w in INTERNALS:
        if w in text:
            raise Violation(f"{where}: the error message shows internals ({w!r}): {text[:300]}")
    try:
        body = json.loads(text)
    except ValueError:
        raise Violation(f"{where}: the error is not JSON: {text[:300]}") from None
    return body


# ---------------------------------------------------------------------------------- uploads
def run_upload(client: httpx.Client, case: UploadCase, stats: Stats) -> None:
    data = encode_upload(case)
    params = dict(case.query)
    if case.multipart:
        files = {case.field_name or "file": (case.filename, data, case.content_type or "application/octet-stream")}
        r = client.post("/v1/enhance", params=params, files=files, data=case.form)
    else:
        headers = {"Content-Type": case.content_type} if case.content_type else {}
        r = client.post("/v1/enhance", params=params, content=data, headers=headers)
    stats.uploads += 1
    stats.status[r.status_code] = stats.status.get(r.status_code, 0) + 1
    if r.status_code >= 500:
        raise Violation(f"upload answered {r.status_code}: {r.text[:300]}")
    if r.status_code == 200:
        y, rate = sf.read(io.BytesIO(r.content), dtype="float32", always_2d=True)
        if (rate, y.shape[1], y.shape[0]) != (int(r.headers["X-Sample-Rate"]), int(r.headers["X-Channels"]),
                                              int(r.headers["X-Frames"])) and "mpeg" not in r.headers["content-type"]:
            raise Violation(f"200 whose audio ({rate} Hz, {y.shape}) disagrees with its headers {dict(r.headers)}")
        if case.clean:
            stats.clean_uploads += 1
            a, info = case.audio, sf.info(io.BytesIO(data))  # the length as any decoder sees it (ADPCM pads blocks)
            if (rate, y.shape[1], y.shape[0]) != (info.samplerate, info.channels, info.frames):
                raise Violation(f"clean upload {a} ({info.frames} frames) came back as {rate} Hz {y.shape}")
        if not np.isfinite(y).all():
            raise Violation("the enhanced audio contains NaN/Inf")
        return
    body = check_error_body(r.text, f"upload {r.status_code}")
    kind = body.get("error", {}).get("kind")
    stats.kinds[str(kind)] = stats.kinds.get(str(kind), 0) + 1
    if kind not in KINDS or KINDS[kind][0] != r.status_code:
        raise Violation(f"status {r.status_code} with error kind {kind!r}: {r.text[:300]}")
    if case.clean and r.status_code != 413:
        raise Violation(f"a valid upload ({case.audio}) was refused: {r.status_code} {r.text[:300]}")


# ---------------------------------------------------------------------------------- websocket sessions
def run_session(host: str, port: int, case: SessionCase, stats: Stats, max_message_bytes: int,
                timeout: float = 15.0) -> None:
    c = RawClient.connect(host, port, "/v1/stream", timeout=timeout)
    sent_samples, width = 0, None
    p = case.start_params
    if p is not None:
        width = (2 if p.get("encoding", "pcm_s16le") == "pcm_s16le" else 4) * p.get("channels", 1)
    try:
        if case.start is not None:
            c.send_text(case.start)
        for a in case.actions:
            if a.kind == "binary":
                c.send_binary(a.data)
                if width:
                    sent_samples += len(a.data) // width
            elif a.kind == "text":
                c.send_text(a.text)
            elif a.kind == "raw":
                c.send_raw(a.data)
            elif a.kind == "ping":
                c.send_frame(OP_PING, b"fz")
            elif a.kind == "pause":
                time.sleep(0.01)
        if case.ending == "end":
            c.send_text('{"type": "end"}')
        elif case.ending == "close":
            c.send_close(1000)
        elif case.ending == "abort":
            c.abort()
            stats.sessions += 1
            stats.codes["aborted"] = stats.codes.get("aborted", 0) + 1
            return
    except (ConnectionError, OSError):
        pass  # the server closed the stream early (an error): read what it said
    frames, code = c.recv_until_close()
    c.close()
    stats.sessions += 1
    stats.codes[code] = stats.codes.get(code, 0) + 1
    texts = [f[1].decode("utf-8", "replace") for f in frames if f[0] == OP_TEXT]
    errors = []
    for t in texts:
        msg = check_error_body(t, f"websocket text (close {code})")
        if isinstance(msg, dict) and msg.get("type") == "error":
            errors.append(msg)
            stats.kinds["ws:" + str(msg.get("kind"))] = stats.kinds.get("ws:" + str(msg.get("kind")), 0) + 1
    if code is None:
        raise Violation(f"the server dropped the connection without a close frame; texts: {texts[-3:]}")
    if code not in CLIENT_ERROR_CODES:
        raise Violation(f"stream closed with {code} for a client's input; texts: {texts[-3:]}")
    for e in errors:
        if e.get("kind") not in KINDS or e.get("code") != code or KINDS[e["kind"]][1] != code:
            raise Violation(f"error message {e} does not match close code {code}")
    if case.is_clean(max_message_bytes):
        stats.clean_sessions += 1
        out = sum(len(f[1]) for f in frames if f[0] == OP_BINARY) // width
        if code != 1000 or out != sent_samples or texts[-1:] != [json.dumps({"type": "end", "samples": sent_samples},
                                                                           separators=(",", ":"))]:
            raise Violation(f"valid session: close {code}, {out} samples out for {sent_samples} in; {texts[-2:]}")


# ---------------------------------------------------------------------------------- driving
def _alive(base: str) -> None:
    try:
        r = httpx.get(base + "/healthz", timeout=10)
    except httpx.HTTPError as e:
        raise Violation(f"the server stopped answering: {e}") from None
    if r.status_code != 200:
        raise Violation(f"/healthz answered {r.status_code}")


def internal_errors(base: str) -> float:
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith('tim_errors_total{kind="internal"}'):
            return float(line.split()[-1])
    return 0.0


def fuzz_uploads(base: str, n: int, stats: Stats, seed: int | None = None) -> None:
    from hypothesis import HealthCheck, Phase, given, settings

    with httpx.Client(base_url=base, timeout=60) as client:
        @settings(max_examples=n, database=None, deadline=None, derandomize=seed is None,
                  suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.shrink])
        @given(uploads)
        def check(case):
            run_upload(client, case, stats)

        if seed is not None:
            from hypothesis import seed as hseed

            check = hseed(seed)(check)
        check()
    _alive(base)


def fuzz_sessions(base: str, n: int, stats: Stats, seed: int | None = None) -> None:
    from hypothesis import HealthCheck, Phase, given, settings

    host, port = base.split("//", 1)[1].split(":")
    limit = httpx.get(base + "/readyz", timeout=10).json()["limits"]["max_message_bytes"]

    @settings(max_examples=n, database=None, deadline=None, derandomize=seed is None,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.shrink])
    @given(sessions())
    def check(case):
        run_session(host, int(port), case, stats, limit)

    if seed is not None:
        from hypothesis import seed as hseed

        check = hseed(seed)(check)
    check()
    _alive(base)


def run_schemathesis(base: str, seconds: float | None = None, out: Path | None = None, max_examples: int | None = None,
                     seed: int | None = None) -> int:
    """schemathesis against the live OpenAPI description, every check but positive_data_acceptance
    (a schema cannot say "a decodable audio file": schema-valid random bytes are rightly 415).
    Bounded by `seconds` or by `max_examples` per operation. Returns its exit code."""
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{base}/openapi.json", "--checks", "all",
           "--exclude-checks", "positive_data_acceptance", "--workers", "1", "--suppress-health-check", "all",
           "--request-timeout", "30"]
    if seconds:
        cmd += ["--max-time", str(int(seconds))]
    if max_examples:
        cmd += ["--max-examples", str(max_examples)]
    if seed is not None:
        cmd += ["--seed", str(seed)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=(seconds or 600) + 300, cwd=REPO_ROOT)
    text = r.stdout + r.stderr
    if out is not None:
        out.write_text(text)
    tail = [ln.strip() for ln in text.splitlines() if "generated" in ln or (" in " in ln and "=====" in ln)]
    print("schemathesis:", "; ".join(tail[-2:]) or text[-500:], flush=True)
    if r.returncode:
        print(text[-6000:], flush=True)
    return r.returncode


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.fuzz", description=__doc__.split("\n")[0])
    p.add_argument("--uploads", type=int, default=1000, help="fuzzed REST uploads")
    p.add_argument("--sessions", type=int, default=200, help="fuzzed websocket sessions")
    p.add_argument("--schemathesis-seconds", type=float, default=0, help="time for schemathesis (0: skip)")
    p.add_argument("--url", help="base URL of a running loopback server (default: start one)")
    p.add_argument("--model", help="model for the started server (default: shipped, else random-weight tim)")
    p.add_argument("--seed", type=int, help="hypothesis seed (default: derandomized, the same cases each run)")
    p.add_argument("--json", help="write the figures to this file")
    args = p.parse_args(argv)
    proc = None
    base = args.url
    if base is None:
        from .launch import start
        from .loadtest import model_path

        proc = start(model_path(args.model), device="cpu", **LIMITS)
        base = proc.base
    elif not base.startswith(("http://127.0.0.1", "http://localhost")):
        raise SystemExit("--url must be a loopback server")
    stats = Stats()
    result = {"ok": False}
    t0 = time.time()
    try:
        internal0 = internal_errors(base)
        if args.uploads:
            fuzz_uploads(base, args.uploads, stats, args.seed)
            print(f"uploads: {stats.uploads} ({stats.clean_uploads} valid), statuses {stats.status}, "
                  f"errors {stats.kinds}", flush=True)
        if args.sessions:
            fuzz_sessions(base, args.sessions, stats, args.seed)
            print(f"sessions: {stats.sessions} ({stats.clean_sessions} valid), close codes {stats.codes}", flush=True)
        internal = internal_errors(base) - internal0
        if internal:
            raise Violation(f"{internal:g} internal error(s) counted by the server")
        st_code = 0
        if args.schemathesis_seconds:
            st_code = run_schemathesis(base, args.schemathesis_seconds,
                                       Path(args.json).with_suffix(".schemathesis.txt") if args.json else None)
        result = stats.summary() | {"ok": st_code == 0, "internal_errors": internal, "schemathesis_exit": st_code,
                                    "seconds": round(time.time() - t0, 1)}
    finally:
        if proc is not None:
            alive = proc.alive()
            proc.stop()
            result["server_crashed"] = not alive
            if not alive:
                print(f"the server process died ({proc.proc.returncode}):", proc.log_tail())
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0 if result.get("ok") and not result.get("server_crashed") else 1


if __name__ == "__main__":
    sys.exit(main())
