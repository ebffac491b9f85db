"""Scale-out on one machine (`make test-cluster`; deselected from the default run): three `enhancer
serve` replicas with fixed capacities (2 streams each) and HAProxy agents, behind Debian's haproxy
running deploy/haproxy.cfg (its server lines pointed at the replicas' loopback ports), clients
through the balancer only (`enhancer/client.py`, which retries 1013 and resumes after 1012 or
a lost connection; uploads retried on 503):

1. as many streams as the capacities add up to (6) are all admitted, none late; one more is refused
   with 1013 (by a replica: the spill-over backups, not HAProxy's bare 503);
2. a replica killed with SIGKILL loses only its own streams, whose clients reconnect through the
   balancer and go on; the others' streams never notice;
3. a rolling restart (SIGTERM, then start again, one replica at a time) while streams and uploads
   run: every upload completes, every stream finishes (1000) or reconnects, and no audio is lost.

Figures (server/README.md, "Scale-out") are printed with -s."""
from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from enhancer.client import enhance_stream
from tests.conftest import speechlike
from tests.tls import certificate, with_certificate
from tools.launch import poll_ready

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
HAPROXY_CFG = ROOT / "deploy" / "haproxy.cfg"
SR = 16000
CAPACITY = 2  # streams per replica
DRAIN_S = 3.0
# "none late" is asserted on a machine that other processes leave free (load average below the cores)
MACHINE_BUSY = os.getloadavg()[0] >= (os.cpu_count() or 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Replica:
    def __init__(self, name: str, model: Path, log_dir: Path):
        self.name, self.model, self.log_dir = name, model, log_dir
        self.port, self.agent_port = free_port(), free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> Replica:
        exe = Path(sys.executable).with_name("enhancer")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "enhancer"]
        self.starts += 1
        log = open(self.log_dir / f"{self.name}-{self.starts}.log", "wb")
        self.proc = subprocess.Popen([*cmd, "serve", "--host", "127.0.0.1", "--port", str(self.port), "--model",
                                      str(self.model), "--device", "cpu", "--workers", "1", "--capacity",
                                      str(CAPACITY), "--agent-port", str(self.agent_port), "--drain-timeout-s",
                                      str(DRAIN_S)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log)
        return self

    def wait_ready(self, timeout: float = 120) -> None:
        if not poll_ready(self.proc, self.base, timeout):
            assert self.proc.poll() is None, f"{self.name} exited: {self.log_tail()}"
            raise AssertionError(f"{self.name} not ready: {self.log_tail()}")

    def active_streams(self) -> int:
        return httpx.get(self.base + "/readyz", timeout=5).json()["active_streams"]

    def log_tail(self) -> str:
        return (self.log_dir / f"{self.name}-{self.starts}.log").read_text(errors="replace")[-2000:]

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Balancer:
    """HAProxy running deploy/haproxy.cfg with its server lines (and spill-over backups) pointed at the replicas."""

    def __init__(self, replicas: list[Replica], tmp: Path):
        haproxy = shutil.which("haproxy")
        if haproxy is None:
            pytest.skip("haproxy not installed (make test-cluster installs Debian's)")
        self.port, self.stats = free_port(), free_port()
        cfg = HAPROXY_CFG.read_text()
        cfg = re.sub(r"maxconn \d+", "maxconn 256", cfg)  # within this machine's open-file limit
        cfg = cfg.replace("bind :8000", f"bind 127.0.0.1:{self.port}")
        cfg = cfg.replace("bind 127.0.0.1:8404", f"bind 127.0.0.1:{self.stats}")
        cfg = with_certificate(cfg, certificate(tmp / "tls").pem, f"127.0.0.1:{free_port()}")  # its TLS bind
        cfg = cfg.replace("log stdout format raw local0", "log stderr format raw local0 notice")
        for i, r in enumerate(replicas, 1):
            cfg = re.sub(rf"(\n[ \t]*server r{i} )127\.0\.0\.1:\d+ agent-port \d+",
                         rf"\g<1>127.0.0.1:{r.port} agent-port {r.agent_port}", cfg)
            cfg = re.sub(rf"(\n[ \t]*server s{i} )127\.0\.0\.1:\d+", rf"\g<1>127.0.0.1:{r.port}", cfg)
        assert all(f":{r.port} " in cfg for r in replicas), cfg
        (tmp / "haproxy.cfg").write_text(cfg)
        self.log = open(tmp / "haproxy.log", "wb")
        self.proc = subprocess.Popen([haproxy, "-f", str(tmp / "haproxy.cfg")], stdout=self.log, stderr=self.log)
        self.url = f"ws://127.0.0.1:{self.port}/v1/stream"
        self.base = f"http://127.0.0.1:{self.port}"

    def states(self) -> dict[str, tuple[str, str]]:
        """Server name -> (status, weight) from the stats page."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.stats}/;csv", timeout=2).read().decode()
        return {r["svname"]: (r["status"].split()[0], r["weight"]) for r in csv.DictReader(io.StringIO(text.lstrip("# ")))
                if r["svname"] not in ("FRONTEND", "BACKEND")}

    def wait_up(self, names: list[str], timeout: float = 60) -> None:
        deadline, states = time.time() + timeout, {}
        while time.time() < deadline:
            assert self.proc.poll() is None, "haproxy exited"
            try:
                states = self.states()
                if all(states.get(n, ("",))[0] == "UP" and states[n][1] != "0" for n in names):
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"not UP in HAProxy: {names}: {states}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture
def cluster(model_path, tmp_path):
    replicas = [Replica(f"r{i}", model_path, tmp_path) for i in (1, 2, 3)]
    try:
        for r in replicas:
            r.start()
        for r in replicas:
            r.wait_ready()
        lb = Balancer(replicas, tmp_path)
        try:
            lb.wait_up(["r1", "r2", "r3"])
            yield replicas, lb
        finally:
            lb.stop()
    finally:
        for r in replicas:
            r.stop(signal.SIGKILL)


class Client:
    """One stream through the balancer with wsclient: its messages, reconnections and result."""

    def __init__(self, lb: Balancer, seconds: float, seed: int):
        self.x = speechlike(int(seconds * SR), SR, seed=seed)
        self.url, self.messages, self.y, self.error = lb.url, [], None, None

    async def run(self) -> None:
        try:
            self.y = await enhance_stream(self.x, SR, self.url, max_retries=40, max_wait_s=2.0,
                                          on_message=self.messages.append)
        except Exception as e:  # reported by the assertions
            self.error = e

    def count(self, **fields) -> int:
        return sum(all(m.get(k) == v for k, v in fields.items()) for m in self.messages)

    @property
    def sessions(self) -> int:
        return self.count(type="ready")

    @property
    def ready_now(self) -> bool:
        return self.sessions >= 1

    def check_complete(self) -> None:
        assert self.error is None, self.error
        assert self.y is not None and self.y.shape == self.x.shape
        end = self.messages[-1]  # finished normally (close 1000), not drained
        assert end["type"] == "end" and set(end) == {"type", "samples"}
        assert 0 <= end["samples"] <= len(self.x)  # the last session's output
        if self.sessions == 1:
            assert end["samples"] == len(self.x)


async def start_streams(lb: Balancer, seconds: float, count: int, seed: int) -> tuple[list[Client], list[asyncio.Task]]:
    """`count` streams of `seconds` each, started 0.3 s apart: (clients, their running tasks)."""
    clients, tasks = [], []
    for i in range(count):
        clients.append(Client(lb, seconds, seed=seed + i))
        tasks.append(asyncio.create_task(clients[-1].run()))
        await asyncio.sleep(0.3)
    return clients, tasks


async def refused_stream(url: str) -> tuple[dict, int]:
    err = {}
    async with connect(url) as ws:
        try:
            await ws.send(json.dumps({"sample_rate": SR}))
        except ConnectionClosed:  # refused at the handshake: the error is queued
            pass
        try:
            async for m in ws:
                err = json.loads(m)
        except ConnectionClosed:
            pass
    return err, ws.close_code


def post(base: str, body: bytes, attempts: int = 40) -> tuple[httpx.Response, int]:
    """POST an upload through the balancer, retrying 503 (Retry-After) and refused connections: (answer, retries)."""
    for k in range(attempts):
        try:
            r = httpx.post(base + "/v1/enhance", content=body, headers={"Content-Type": "audio/wav"}, timeout=60)
        except httpx.TransportError:
            time.sleep(0.5)
            continue
        if r.status_code != 503:
            return r, k
        time.sleep(min(float(r.headers.get("Retry-After", 1)), 1.0))
    raise AssertionError("upload never accepted")


def test_three_replicas_behind_haproxy(cluster):
    replicas, lb = cluster
    figures = {}
    t_all = time.time()

    # 1. the sum of the capacities admitted, on time; one more refused with 1013
    async def admission():
        clients, tasks = await start_streams(lb, 6.0, 3 * CAPACITY, seed=100)
        deadline = time.time() + 20
        while not all(c.ready_now for c in clients):
            assert time.time() < deadline, [c.messages[:2] for c in clients]
            await asyncio.sleep(0.1)
        per_replica = [await asyncio.to_thread(r.active_streams) for r in replicas]
        await asyncio.sleep(1.5)  # the agents report every replica full: weights 0
        err, code = await refused_stream(lb.url)
        await asyncio.gather(*tasks)
        return clients, per_replica, err, code

    clients, per_replica, err, code = asyncio.run(admission())
    for c in clients:
        c.check_complete()
        assert c.sessions == 1 and c.count(type="error") == 0, c.messages[:3]  # admitted at once, never refused
    late = sum(c.count(type="late") + c.count(type="gap") for c in clients)
    assert per_replica == [CAPACITY] * 3
    assert code == 1013 and err["kind"] == "over_capacity" and err["capacity"] == CAPACITY, (code, err)
    figures["admission"] = dict(streams=len(clients), per_replica=per_replica, late_or_gap=late, extra_close=code)
    if MACHINE_BUSY:  # other processes hold the cores: lateness is theirs, not the balancer's (reported)
        import warnings

        warnings.warn(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores before the test: "
                      f"{late} late/gap notices reported, not asserted", stacklevel=2)
    else:
        assert late == 0, [c.messages for c in clients if c.count(type="late")]

    # 2. SIGKILL one replica: only its streams reconnect, through the balancer, and go on
    async def kill():
        clients, tasks = await start_streams(lb, 8.0, 4, seed=200)
        await asyncio.sleep(1.5)
        held = [await asyncio.to_thread(r.active_streams) for r in replicas]
        victim = replicas[int(np.argmax(held))]
        victim.proc.send_signal(signal.SIGKILL)
        await asyncio.gather(*tasks)
        return clients, held, victim

    clients, held, victim = asyncio.run(kill())
    for c in clients:
        c.check_complete()
    reconnected = [c for c in clients if c.sessions > 1]
    assert len(reconnected) == max(held), (held, [c.sessions for c in clients])  # exactly the victim's streams
    assert all(c.sessions == 1 for c in clients if c not in reconnected)
    figures["sigkill"] = dict(streams=len(clients), held=held, reconnected=len(reconnected),
                              others_undisturbed=len(clients) - len(reconnected))
    victim.proc.wait(timeout=10)
    victim.start().wait_ready()
    lb.wait_up(["r1", "r2", "r3"])

    # 3. rolling restart while streams and uploads run
    wav = io.BytesIO()
    sf.write(wav, speechlike(SR, SR, seed=300), SR, format="WAV", subtype="FLOAT")
    body = wav.getvalue()
    uploads: list[tuple[int, int, int]] = []  # (status, frames, retries)
    stop_uploads = threading.Event()

    def upload_loop():
        while not stop_uploads.is_set():
            r, retries = post(lb.base, body)
            frames = len(sf.read(io.BytesIO(r.content))[0]) if r.status_code == 200 else -1
            uploads.append((r.status_code, frames, retries))
            time.sleep(0.3)

    async def rolling():
        clients, tasks = await start_streams(lb, 50.0, 4, seed=400)
        uploader = threading.Thread(target=upload_loop, daemon=True)
        uploader.start()
        drains = []
        for r in replicas:
            await asyncio.sleep(2.0)
            t = time.time()
            await asyncio.to_thread(r.stop)  # SIGTERM: the drain, then the exit
            drains.append(round(time.time() - t, 1))
            assert r.proc.returncode == -signal.SIGTERM, r.log_tail()
            await asyncio.to_thread(lambda r=r: r.start().wait_ready())
            await asyncio.to_thread(lb.wait_up, ["r1", "r2", "r3"])
        await asyncio.gather(*tasks)
        stop_uploads.set()
        await asyncio.to_thread(uploader.join, 120)
        return clients, drains

    clients, drains = asyncio.run(rolling())
    for c in clients:
        c.check_complete()  # every stream got all its audio back and ended with 1000
    moved = sum(c.count(type="end", reason="shutdown") for c in clients)
    # each stream reconnected only after a drain's 1012 (tail and end "shutdown" first): no connection lost
    assert all(c.sessions == 1 + c.count(type="end", reason="shutdown") for c in clients), \
        [[m for m in c.messages if m.get("type") != "metadata"][-4:] for c in clients]
    assert uploads and all(status == 200 and frames == SR for status, frames, _ in uploads), uploads
    figures["rolling"] = dict(streams=len(clients), stream_s=50, reconnects_after_1012=moved,
                              uploads=len(uploads), upload_retries_503=sum(k for *_, k in uploads),
                              drain_exit_s=drains)
    figures["total_s"] = round(time.time() - t_all, 1)
    load = os.getloadavg()
    figures["load_average"] = [round(x, 2) for x in load]
    figures["machine_busy_before"] = MACHINE_BUSY
    print("\ncluster figures:", json.dumps(figures))
