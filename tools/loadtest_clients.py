"""The load generator's websocket clients: each streams audio at real-time pace and times the
enhanced audio it reads back (`Client`); the generator's own event-loop lag (`LagProbe`); all of
them at once, with the machine-stall observer alongside (`run_observed`). Used by `tools.loadtest`
and `tools.soak`.
"""
from __future__ import annotations

import asyncio
import json
import time

import numpy as np

from .machine_stalls import MachineStallObserver


class Client:
    def __init__(self, index: int, audio: np.ndarray, rate: int, chunk: int, offset: int):
        self.index, self.audio, self.rate, self.chunk, self.offset = index, audio, rate, chunk, offset
        self.sent_times: list[float] = []  # send time of chunk k (covers samples [k*chunk, (k+1)*chunk))
        self.latencies: list[float] = []
        self.arrivals: list[float] = []  # perf_counter time of each latency sample
        self.samples_out = 0
        self.error: str | None = None
        self.delay_samples = 0
        self.refused: dict | None = None  # the error message of a refusal over capacity
        self.close_code: int | None = None
        self.events: dict[str, int] = {"late": 0, "on_time": 0, "gap": 0}  # server notices received
        self.gap_samples = 0

    def chunk_at(self, k: int) -> bytes:
        n = len(self.audio)
        start = (self.offset + k * self.chunk) % n
        idx = (start + np.arange(self.chunk)) % n
        return self.audio[idx].tobytes()

    async def run(self, url: str, t0: float, seconds: float, start_delay: float) -> None:
        import websockets
        from websockets.exceptions import ConnectionClosed

        try:
            async with websockets.connect(url, max_size=None, ping_interval=None) as ws:
                try:
                    await ws.send(json.dumps({"sample_rate": self.rate, "encoding": "pcm_s16le", "channels": 1}))
                except ConnectionClosed:  # refused at the handshake before the start message went out
                    pass
                try:
                    ready = json.loads(await ws.recv())
                except ConnectionClosed as e:
                    self.close_code = e.rcvd.code if e.rcvd else None
                    self.error = f"closed before the ready message ({self.close_code})"
                    return
                if ready.get("type") == "error" and ready.get("kind") == "over_capacity":
                    self.refused = ready
                    try:
                        await ws.recv()
                    except ConnectionClosed as e:
                        self.close_code = e.rcvd.code if e.rcvd else None
                    return
                if ready.get("type") != "ready":
                    self.error = f"no ready message: {ready}"
                    return
                self.delay_samples = ready["delay_samples"]
                reader = asyncio.create_task(self._read(ws))
                n_chunks = int(seconds * self.rate / self.chunk)
                start = t0 + start_delay
                period = self.chunk / self.rate
                for k in range(n_chunks):
                    wait = start + k * period - time.perf_counter()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    self.sent_times.append(time.perf_counter())
                    await ws.send(self.chunk_at(k))
                await ws.send(json.dumps({"type": "end"}))
                await reader
        except Exception as e:  # reported in the summary
            self.error = f"{type(e).__name__}: {e}"

    async def _read(self, ws) -> None:
        try:
            await self._read_messages(ws)
        except Exception as e:  # the connection ended abnormally: reported in the summary
            self.error = self.error or f"{type(e).__name__}: {e}"

    async def _read_messages(self, ws) -> None:
        async for message in ws:
            now = time.perf_counter()
            if isinstance(message, str):
                msg = json.loads(message)
                if msg.get("type") == "error":
                    self.error = msg["message"]
                elif msg.get("type") in self.events:
                    self.events[msg["type"]] += 1
                    self.gap_samples += msg.get("samples", 0)
                continue
            first = self.samples_out  # oldest sample in this message
            self.samples_out += len(message) // 2
            k = first // self.chunk
            if k < len(self.sent_times):
                self.latencies.append(now - self.sent_times[k])
                self.arrivals.append(now)


class LagProbe:
    """The load generator's own event-loop lag (it shares the machine with the server): a message
    that arrives while this process is stalled looks late although the server sent it in time.
    Records (time, lag) of every wake-up more than `record_s` behind its 10 ms timer."""

    def __init__(self, interval: float = 0.01, record_s: float = 0.01):
        self.interval, self.record_s = interval, record_s
        self.events: list[tuple[float, float]] = []  # (perf_counter, lag s)
        self.max_lag = 0.0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            due = time.perf_counter() + self.interval
            await asyncio.sleep(self.interval)
            lag = time.perf_counter() - due
            self.max_lag = max(self.max_lag, lag)
            if lag > self.record_s:
                self.events.append((due, lag))

    def stalls(self, over_s: float) -> int:
        return sum(lag > over_s for _, lag in self.events)


async def run_observed(url: str, audio: np.ndarray, rate: int, args):
    """run_clients with the load generator's lag probe alongside and the machine-stall observer
    process running meanwhile: (clients, probe, observer)."""
    probe, observer, stop = LagProbe(), MachineStallObserver().start(), asyncio.Event()
    probing = asyncio.create_task(probe.run(stop))
    try:
        clients = await run_clients(url, audio, rate, args)
    finally:
        stop.set()
        await probing
        observer.stop()
    return clients, probe, observer


async def run_clients(url: str, audio: np.ndarray, rate: int, args) -> list[Client]:
    chunk = int(rate * args.chunk_ms / 1000)
    rng = np.random.default_rng(0)
    clients = [Client(i, audio, rate, chunk, int(rng.integers(len(audio)))) for i in range(args.streams)]
    t0 = time.perf_counter() + 0.5
    period = chunk / rate
    await asyncio.gather(*(c.run(url, t0, args.seconds, period * i / max(args.streams, 1))
                           for i, c in enumerate(clients)))
    return clients
