"""Prometheus metrics of one app (own registry, so several apps can live in one process)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from server.errors import KINDS
from server.messages import Source

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.032, 0.064, 0.1, 0.25, 0.5, 1.0)
LATENESS_BUCKETS = (0.004, 0.008, 0.016, 0.024, 0.032, 0.048, 0.064, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
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
        # admission (server.scheduling.admission, server.scheduling.capacity) and lateness of live streams (server.scheduling.lateness)
        self.capacity = Gauge("tim_capacity_streams", "Live streams admitted at most (measured at start-up and "
                              "re-estimated while serving, or the capacity setting); tim_active_streams is the "
                              "live count", registry=r)
        self.live_lanes = Gauge("tim_live_lanes", "Lanes held by admitted live streams (each channel counts, as "
                                "admission counts them against tim_capacity_streams)", registry=r)
        self.capacity_changes = Counter("tim_capacity_changes", "Times the capacity was re-estimated up or down "
                                        "while serving", ["direction"], registry=r)
        self.projected_step = Gauge("tim_capacity_projected_step_seconds", "Step p95 each worker's live timings "
                                    "project at its capacity (the budget is tim_capacity_step_budget_seconds)",
                                    ["worker"], registry=r)
        self.draining = Gauge("tim_draining", "1 from SIGTERM on (the drain), else 0", registry=r)
        self.capacity_worker = Gauge("tim_capacity_worker_streams", "Live stream lanes each worker holds within the "
                                     "step budget", ["worker"], registry=r)
        self.step_budget = Gauge("tim_capacity_step_budget_seconds", "Step p99 allowed when calibrating: hop x (1 - "
                                 "capacity_margin)", registry=r)
        self.calibrated = Gauge("tim_capacity_calibrated", "1 when the capacity was measured at start-up, 0 when "
                                "fixed by the settings", registry=r)
        self.refused = Counter("tim_refused", "Streams and REST jobs refused for capacity (1013 / 503)", ["source"],
                               registry=r)
        self.lateness = Histogram("tim_stream_lateness_seconds", "Per live hop: from its audio's arrival to the end "
                                  "of its step", buckets=LATENESS_BUCKETS, registry=r)
        self.worst_lateness = Gauge("tim_stream_lateness_worst_seconds", "Lateness of the latest live hop of the "
                                    "stream furthest behind in each worker's last step", ["worker"], registry=r)
        self.late_hops = Counter("tim_late_hops", "Live hops stepped later than lateness_budget_ms", registry=r)
        self.behind = Counter("tim_streams_behind", "Times a live stream fell behind lateness_budget_ms (the client "
                              "got a 'late' message)", registry=r)
        self.skipped_hops = Counter("tim_skipped_hops", "Live hops skipped (output zeros) because their stream was "
                                    "later than max_lateness_ms", registry=r)
        self.gaps = Counter("tim_gaps", "Backlogs skipped (each one a 'gap' message to its client)", registry=r)
        # per API key (server.api.keys), labelled by the key's name in the key file, never by the key
        self.api_keys = Gauge("tim_api_keys", "API key names in force (0: no authentication)", registry=r)
        self.key_active_streams = Gauge("tim_key_active_streams", "Open websocket streams per API key", ["key_name"],
                                        registry=r)
        self.key_streams = Counter("tim_key_streams", "Websocket streams opened per API key (past its own limit)",
                                   ["key_name"], registry=r)
        self.key_requests = Counter("tim_key_requests", "POST /v1/enhance requests per API key, by status",
                                    ["key_name", "status"], registry=r)
        self.key_audio = Counter("tim_key_audio_seconds", "Audio per API key: received on streams, enhanced in "
                                 "uploads", ["key_name", "source"], registry=r)
        self.key_refused = Counter("tim_key_refused", "Refusals per API key, by reason: streams, requests, "
                                   "upload_length (its own limits), capacity (the server's)", ["key_name", "reason"],
                                   registry=r)
        self.key_reloads = Counter("tim_key_reloads", "Key file reloads (SIGHUP, POST /v1/admin/reload), by result",
                                   ["result"], registry=r)
        for result in ("ok", "error"):
            self.key_reloads.labels(result=result)
        for source in Source:
            self.refused.labels(source=source)
            self.frames.labels(source=source)
        for direction in ("up", "down"):
            self.capacity_changes.labels(direction=direction)
        for kind in KINDS:
            self.errors.labels(kind=kind)

    def render(self) -> bytes:
        return generate_latest(self.registry)
