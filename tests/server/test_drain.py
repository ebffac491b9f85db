"""The graceful drain on SIGTERM and the HAProxy agent (server/README.md, "Operations"; deploy/README.md,
"What the server provides"): /readyz 503 at once while the server keeps listening, /healthz 200 until
exit, new streams and uploads refused, uploads in flight complete, live streams run on for the drain
timeout and then get their tail and 1012 with a message to reconnect; the agent's line in every state;
the drain timeout and agent port from the environment and the command line."""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import soundfile as sf
from websockets.asyncio.client import connect as aconnect
from websockets.exceptions import ConnectionClosed

from server.agent import status_line
from server.settings import Settings
from tests.conftest import speechlike

ROOT = Path(__file__).resolve().parents[2]
SR = 16000


def test_agent_line_in_every_state():
    def app(draining=False, ready=True, capacity=8, free=6):
        cap = None if capacity is None else SimpleNamespace(streams=capacity)
        scheduler = SimpleNamespace(ready=ready, capacity=cap, admission=SimpleNamespace(free=free))
        return SimpleNamespace(state=SimpleNamespace(draining=draining, scheduler=scheduler))

    assert status_line(app()) == b"75% ready up\n"
    assert status_line(app(free=8)) == b"100% ready up\n"
    assert status_line(app(capacity=3, free=1)) == b"33% ready up\n"  # floor
    assert status_line(app(free=0)) == b"0% ready up\n"  # full
    assert status_line(app(draining=True)) == b"drain\n"
    assert status_line(app(ready=False)) == b"down\n"
    assert status_line(app(capacity=None)) == b"down\n"


def test_drain_timeout_and_agent_port_from_the_environment_and_the_command_line(monkeypatch):
    monkeypatch.setenv("TIM_ENHANCER_DRAIN_TIMEOUT_S", "50")
    monkeypatch.setenv("TIM_ENHANCER_AGENT_PORT", "8001")
    s = Settings.build()
    assert s.drain_timeout_s == 50.0 and s.agent_port == 8001
    s = Settings.build(drain_timeout_s=2.5, agent_port=9001)  # a keyword argument (the command line) wins
    assert s.drain_timeout_s == 2.5 and s.agent_port == 9001
    monkeypatch.setenv("TIM_ENHANCER_DRAIN_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="TIM_ENHANCER_DRAIN_TIMEOUT_S"):
        Settings.build()
    monkeypatch.setenv("TIM_ENHANCER_DRAIN_TIMEOUT_S", "-1")
    with pytest.raises(ValueError, match="drain_timeout_s"):
        Settings.build()
    monkeypatch.delenv("TIM_ENHANCER_DRAIN_TIMEOUT_S")
    monkeypatch.setenv("TIM_ENHANCER_AGENT_PORT", "70000")
    with pytest.raises(ValueError, match="agent_port"):
        Settings.build()
    monkeypatch.delenv("TIM_ENHANCER_AGENT_PORT")
    assert Settings.build().agent_port is None and Settings.build().drain_timeout_s == 10.0
    from server.cli import add_serve

    top = argparse.ArgumentParser()
    add_serve(top.add_subparsers(dest="command"))
    a = top.parse_args(["serve", "--drain-timeout-s", "50", "--agent-port", "8001"])
    assert a.drain_timeout_s == 50.0 and a.agent_port == 8001
    a = top.parse_args(["serve"])
    assert a.drain_timeout_s is None and a.agent_port is None  # the environment, else the defaults


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        data = b""
        while chunk := s.recv(100):
            data += chunk
        return data


def test_sigterm_drain_keeps_listening_while_streams_run_on(model_path):
    """`enhancer serve` with the drain timeout (3 s) and the agent port from the environment. SIGTERM
    while stream A streams at real-time pace (6 s of audio), stream B is about to end and an upload
    is in flight: at once /readyz answers 503 {"draining": true}, /healthz 200, the agent "drain", a
    new stream gets shutting_down and 1012, a new upload 503; B ends normally (1000, all its output);
    A keeps getting output, then at 3 s its tail, the end message with a reconnect hint, and 1012;
    the upload completes; /healthz answers 200 until the process exits, by the signal, right after."""
    port, agent_port = _free_port(), _free_port()
    env = os.environ | {"TIM_ENHANCER_DRAIN_TIMEOUT_S": "3", "TIM_ENHANCER_AGENT_PORT": str(agent_port)}
    exe = Path(sys.executable).with_name("enhancer")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "enhancer"]
    proc = subprocess.Popen([*cmd, "serve", "--port", str(port), "--model", str(model_path), "--device", "cpu",
                             "--workers", "1", "--capacity", "4"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    base, url = f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}/v1/stream"
    health: list[tuple[float, int | None]] = []
    stop_polling = threading.Event()
    try:
        deadline = time.time() + 90
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.time() < deadline, "server did not become ready"
            try:
                if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert _agent(agent_port) == b"100% ready up\n"

        def poll_health():  # /healthz until the process is gone
            with httpx.Client(timeout=2) as c:
                while not stop_polling.is_set():
                    try:
                        health.append((time.time(), c.get(base + "/healthz").status_code))
                    except httpx.HTTPError:
                        health.append((time.time(), None))
                    time.sleep(0.1)

        threading.Thread(target=poll_health, daemon=True).start()
        a_audio = speechlike(6 * SR, SR, seed=81)
        b_audio = speechlike(int(1.5 * SR), SR, seed=82)
        wav = io.BytesIO()
        sf.write(wav, speechlike(3 * SR, SR, seed=83), SR, format="WAV", subtype="FLOAT")
        body = wav.getvalue()

        async def stream(x, end: bool):
            """Real-time pace in 20 ms chunks; `end`: send the end message after the audio. Returns
            (output samples, [(time, n) of each output message], text messages, close code)."""
            got, texts = [], []
            async with aconnect(url, max_size=None) as ws:
                await ws.send(json.dumps({"sample_rate": SR, "encoding": "f32le"}))
                assert json.loads(await ws.recv())["type"] == "ready"

                async def send():
                    t0 = time.perf_counter()
                    try:
                        for i in range(0, len(x), 320):
                            await ws.send(x[i:i + 320].astype("<f4").tobytes())
                            await asyncio.sleep(max(0.0, t0 + (i + 320) / SR - time.perf_counter()))
                        if end:
                            await ws.send(json.dumps({"type": "end"}))
                    except ConnectionClosed:
                        pass

                sender = asyncio.create_task(send())
                try:
                    async for m in ws:
                        if isinstance(m, bytes):
                            got.append((time.time(), len(m) // 4))
                        else:
                            texts.append(json.loads(m))
                except ConnectionClosed:
                    pass
                sender.cancel()
                return sum(n for _, n in got), got, texts, ws.close_code

        def upload():
            def slowly():  # the upload is still arriving when the signal comes
                for i in range(0, len(body), 64_000):
                    yield body[i:i + 64_000]
                    time.sleep(0.15)

            return httpx.post(base + "/v1/enhance", content=slowly(), timeout=60,
                              headers={"Content-Type": "audio/wav", "Content-Length": str(len(body))})

        async def new_stream():
            async with aconnect(url) as ws:
                err = json.loads(await ws.recv())
                with pytest.raises(ConnectionClosed):
                    await ws.recv()
                return err, ws.close_code

        async def run():
            a = asyncio.create_task(stream(a_audio, end=False))
            await asyncio.sleep(0.3)
            b = asyncio.create_task(stream(b_audio, end=True))
            rest = asyncio.create_task(asyncio.to_thread(upload))
            await asyncio.sleep(0.8)
            assert await asyncio.to_thread(_agent, agent_port) == b"50% ready up\n"  # 2 of 4 streams
            t_signal = time.time()
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            with httpx.Client(base_url=base, timeout=5) as c:
                r = await asyncio.to_thread(c.get, "/readyz")
                assert r.status_code == 503 and r.json() == {"ready": False, "draining": True}, r.text
                assert (await asyncio.to_thread(c.get, "/healthz")).status_code == 200
                late_upload = await asyncio.to_thread(c.post, "/v1/enhance", content=body,
                                                      headers={"Content-Type": "audio/wav"})
            assert await asyncio.to_thread(_agent, agent_port) == b"drain\n"
            err, code = await new_stream()
            assert code == 1012 and err["kind"] == "shutting_down" and "reconnect" in err["message"], err
            return t_signal, await a, await b, await rest, late_upload

        t_signal, (a_n, a_msgs, a_texts, a_code), (b_n, _, b_texts, b_code), response, late = asyncio.run(run())
        exit_code = proc.wait(timeout=30)
        t_exit = time.time()
        stop_polling.set()
        # B ended on its own during the drain
        assert b_code == 1000 and b_texts[-1] == {"type": "end", "samples": len(b_audio)} and b_n == len(b_audio)
        # A ran on for the drain timeout, then got its tail, the reconnect hint and 1012
        end = a_texts[-1]
        assert a_code == 1012 and end["type"] == "end" and end["reason"] == "shutdown", a_texts[-2:]
        assert end["samples"] == a_n and f"from sample {a_n}" in end["message"] and "reconnect" in end["message"]
        assert max(t for t, _ in a_msgs) > t_signal + 2.5  # output kept coming during the grace period
        assert 2.5 * SR < a_n < len(a_audio), a_n  # about 4 s streamed: cut at the drain timeout
        # the upload in flight completed; the one sent during the drain was refused
        assert response.status_code == 200, response.text[:300]
        out, out_sr = sf.read(io.BytesIO(response.content), dtype="float32")
        assert out.shape == (3 * SR,) and out_sr == SR
        assert late.status_code == 503 and late.json()["error"]["kind"] == "shutting_down"
        assert int(late.headers["Retry-After"]) >= 1
        # /healthz answered 200 until the end, then the process exited by the signal
        assert exit_code == -signal.SIGTERM, proc.stderr.read().decode()[-2000:]
        answered = [t for t, status in health if status == 200]
        assert all(status in (200, None) for _, status in health), health
        assert max(answered) > t_signal + 2.5 and t_exit - t_signal < 8, (t_exit - t_signal, health[-5:])
        log = proc.stderr.read().decode()
        assert "draining: /readyz answers 503" in log and "HAProxy agent on port" in log, log[-3000:]
    finally:
        stop_polling.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
