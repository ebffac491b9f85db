"""The example websocket client (enhancer/client.py) against the real server: a plain run equals
offline enhancement; a refusal over capacity (1013) is retried after the hint; a restart (1012
mid-stream, then nothing listening for a while) is resumed with no output lost."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import numpy as np
import pytest
from websockets.sync.client import connect

import server
from enhancer.client import enhance_file, enhance_stream, main
from server.settings import Settings
from tests.conftest import speechlike
from tests.server.conftest import TEST_LIMITS, LiveServer
from tests.tolerance import assert_close_to_peak

SR = 16000


def test_round_trip_equals_offline(live, enhancer_rt):
    x = speechlike(int(1.3 * SR), SR, seed=71)
    messages = []
    y, rate = asyncio.run(enhance_file(x, live.ws_url, sample_rate=SR, speed=4, on_message=messages.append))
    assert rate == SR and y.shape == x.shape
    assert messages[0]["type"] == "ready" and messages[-1] == {"type": "end", "samples": len(x)}
    assert_close_to_peak(y, enhancer_rt.enhance(x, SR))
    # several channels keep their layout
    x2 = speechlike(SR // 2, SR, seed=72, channels=2)
    y2 = asyncio.run(enhance_stream(x2, SR, live.ws_url, speed=4))
    assert y2.shape == x2.shape
    assert_close_to_peak(y2, enhancer_rt.enhance(x2, SR).reshape(x2.shape))
    live.wait_idle()


def test_command_line(live, enhancer_rt, tmp_path, capsys):
    import soundfile as sf

    x = speechlike(SR // 2, SR, seed=75)
    sf.write(tmp_path / "noisy.wav", x, SR, subtype="FLOAT")
    assert main([str(tmp_path / "noisy.wav"), "-o", str(tmp_path / "clean.wav"), "--url", live.ws_url,
                 "--speed", "4"]) == 0
    y, rate = sf.read(tmp_path / "clean.wav", dtype="float32")
    assert rate == SR and y.shape == x.shape
    assert_close_to_peak(y, enhancer_rt.enhance(x, SR), plus=1 / 32768)  # written as 16-bit PCM
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {"type": "end", "samples": len(x)}


def test_over_capacity_waits_and_retries(model_path, enhancer_rt):
    srv = LiveServer(model=model_path, **(TEST_LIMITS | dict(max_streams=1, capacity=1)))
    try:
        x = speechlike(SR // 2, SR, seed=73)
        messages = []

        async def run():
            with connect(srv.ws_url) as blocker:  # holds the only place
                blocker.send(json.dumps({"sample_rate": SR}))
                assert json.loads(blocker.recv(timeout=10))["type"] == "ready"
                client = asyncio.create_task(enhance_stream(x, SR, srv.ws_url, speed=4, max_wait_s=0.2,
                                                            max_retries=100, on_message=messages.append))
                while not any(m.get("code") == 1013 for m in messages):
                    assert not client.done(), client
                    await asyncio.sleep(0.05)
            return await client  # the blocker has gone: the retry is admitted

        y = asyncio.run(run())
        refusals = [m for m in messages if m.get("type") == "error"]
        assert refusals and all(m["kind"] == "over_capacity" and m["code"] == 1013 for m in refusals), refusals
        assert refusals[0]["retry_after_s"] > 0 and refusals[0]["capacity"] == 1
        assert messages[-1] == {"type": "end", "samples": len(x)}
        assert_close_to_peak(y, enhancer_rt.enhance(x, SR))
    finally:
        srv.stop()


def _serve_on(port: int, model_path):
    """A server on a given loopback port (a restart of one that was there): (uvicorn server, thread)."""
    settings = Settings.build(model=model_path, **TEST_LIMITS)
    app = server.create_app(settings)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    srv = server.Server(server.uvicorn_config(app, settings, port=port, log_level="warning"), app)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not srv.started:
        assert thread.is_alive() and time.time() < deadline, "restarted server did not start"
        time.sleep(0.02)
    return srv, thread


@pytest.mark.parametrize("overlap_s", [0.0, 0.5])
def test_restart_mid_stream_resumes_without_loss(model_path, enhancer_rt, overlap_s):
    first = LiveServer(model=model_path, **(TEST_LIMITS | dict(drain_timeout_s=0.3)))  # streams closed 0.3 s in
    second = None
    try:
        x = speechlike(3 * SR, SR, seed=74)
        messages = []

        async def run():
            nonlocal second
            client = asyncio.create_task(enhance_stream(x, SR, first.ws_url, speed=1, resume_overlap_s=overlap_s,
                                                        on_message=messages.append))
            await asyncio.sleep(1.0)
            await asyncio.to_thread(first.stop)  # drains: the tail, end "shutdown", close 1012
            await asyncio.sleep(0.5)  # nothing listens meanwhile: the client backs off and retries
            second = await asyncio.to_thread(_serve_on, first.port, model_path)
            return await client

        y = asyncio.run(run())
        ends = [m for m in messages if m.get("type") == "end"]
        assert len(ends) == 2 and ends[0]["reason"] == "shutdown" and "reason" not in ends[1], ends
        n = ends[0]["samples"]  # what the first server read and enhanced
        assert 0 < n < len(x)
        assert y.shape == x.shape
        # before the restart: the first stream, tail included; after: a new stream from n - overlap
        assert_close_to_peak(y[:n], enhancer_rt.enhance(x[:n], SR))
        begin = max(0, n - int(overlap_s * SR))
        assert ends[1]["samples"] == len(x) - begin
        assert_close_to_peak(y[n:], enhancer_rt.enhance(x[begin:], SR)[n - begin:])
    finally:
        first.stop()
        if second is not None:
            second[0].should_exit = True
            second[1].join(timeout=15)


def test_no_server_fails_at_once():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    url = f"ws://127.0.0.1:{sock.getsockname()[1]}/v1/stream"
    try:
        t = time.perf_counter()
        with pytest.raises(ConnectionError, match="cannot connect"):
            asyncio.run(enhance_stream(np.zeros(SR, np.float32), SR, url))
        assert time.perf_counter() - t < 5
    finally:
        sock.close()
