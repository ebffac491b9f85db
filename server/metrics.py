"""Prometheus metrics of one app (own registry, so several apps can live in one process)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .errors import KINDS

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.032, 0.064, 0.1, 0.25, 0.5, 1.0)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.012, 0.016, 0.024, 0.032, 0.048, 0.064, 0.1, 0.25)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.active_streams = Gauge("tim_active_streams", "Open websocket streams", registry=r)
        self.active_jobs = Gauge("tim_active_rest_jobs", "REST enhancements in progress", registry=r)
        self.lanes_in_use = Gauge("tim_lanes_in_use", "Lanes (stream channels) held, per worker", ["worker"], registry=r)
        self.frames = Counter("tim_frames", "16 ms hops enhanced (one per stream per step)", ["source"], registry=r)
        self.batch_size = Histogram("tim_batch_size", "Lanes stepped per inference call", buckets=BATCH_BUCKETS, registry=r)
        self.step_seconds = Histogram("tim_step_seconds", "Duration of one batched inference step", buckets=STEP_BUCKETS,
                                      registry=r)
        self.errors = Counter("tim_errors", "Errors reported to clients, by kind", ["kind"], registry=r)
        self.rest_requests = Counter("tim_rest_requests", "POST /v1/enhance requests, by status", ["status"], registry=r)
        self.rest_seconds = Histogram("tim_rest_request_seconds", "POST /v1/enhance duration", registry=r)
        self.stalled = Counter("tim_stalled_connections", "Connections dropped because the client read nothing for "
                               "idle_timeout_s while output waited", registry=r)
        self.stream_seconds = Counter("tim_stream_audio_seconds", "Audio received on websocket streams", registry=r)
        self.loop_lag = Histogram("tim_event_loop_lag_seconds", "How late the event loop ran a 50 ms timer",
                                  buckets=LAG_BUCKETS, registry=r)
        self.gc_pause = Histogram("tim_gc_pause_seconds", "Duration of each collection of generation 1 or 2", ["generation"],
                                  buckets=LAG_BUCKETS, registry=r)
        for kind in KINDS:
            self.errors.labels(kind=kind)
        for source in ("stream", "rest"):
            self.frames.labels(source=source)

    def render(self) -> bytes:
        return generate_latest(self.registry)
