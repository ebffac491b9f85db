"""Service settings: one frozen object built from keyword arguments and environment variables.

Every limit has a default that suits one machine serving real-time streams; `Settings.build`
validates types and ranges and names the offending field in its error.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from enhancer.devices import DEVICES
from enhancer.signal import MAX_CHANNELS

API_KEY_ENV = "TIM_ENHANCER_API_KEY"
API_KEYS_FILE_ENV = "TIM_ENHANCER_API_KEYS_FILE"
CORS_ENV = "TIM_ENHANCER_CORS_ORIGINS"
DRAIN_ENV = "TIM_ENHANCER_DRAIN_TIMEOUT_S"
AGENT_ENV = "TIM_ENHANCER_AGENT_PORT"
STEP_KEY_ENV = "TIM_ENHANCER_STEP_KEY"


@dataclass(frozen=True)
class Settings:
    model: Path | None = None  # None: the shipped model (enhancer.runtime.default_model_path())
    device: str = "auto"  # auto (CUDA when present, else CPU), cpu or cuda
    # inference threads, each with its own lane pool on one shared onnxruntime session; None: one per
    # CPU this process may use (affinity and cgroup quota, server.scheduling.cpus) on the CPU, 1 with device "cuda"
    workers: int | None = None
    threads: int = 1  # onnxruntime intra-op threads per worker
    max_streams: int = 64  # concurrent websocket streams (1013 beyond)
    max_rest_jobs: int = 4  # concurrent REST enhancements (503 beyond)
    max_channels: int = 8  # channels of one stream or file
    max_batch_wait_ms: float = 12.0  # a ready hop may wait this long for other live streams to join its step
    # admission and lateness (server/README.md, "Capacity, admission and lateness")
    capacity: int | None = None  # live streams admitted; None: measured at start-up (server.scheduling.capacity)
    capacity_margin: float = 0.3  # share of the 16 ms hop the step (median x tail factor) must leave free
    # the event loop's CPU per live stream and hop (receive, decode, send), reproduced while calibrating;
    # /readyz shows the figure measured while serving ("loop_ms_per_stream")
    loop_ms: float = 0.2
    # a measured capacity follows the machine while serving (server.scheduling.capacity.CapacityTracker): raised when
    # the live steps leave the margin free for capacity_raise_s, lowered when they overrun the budget for
    # capacity_lower_s (never below the streams admitted); False: measured once at start-up
    capacity_follow: bool = True
    capacity_raise_s: float = 10.0
    capacity_lower_s: float = 3.0
    lateness_budget_ms: float = 40.0  # a hop stepped later than this after it arrived: the client is told
    max_lateness_ms: float = 60.0  # a live stream later than this skips its backlog (a marked gap)
    api_key: str | None = None  # required on /v1/* when set (REST header, websocket header or query)
    # TOML or JSON file of named API keys with their own limits (server.api.keyfile), re-read on SIGHUP and
    # POST /v1/admin/reload; instead of api_key. Also $TIM_ENHANCER_API_KEYS_FILE
    api_keys_file: Path | None = None
    # TLS: serve https and wss with this certificate (PEM, chain first) and private key (PEM)
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    cors_origins: tuple[str, ...] = ()  # origins allowed by CORS; () = no CORS headers
    # REST limits
    max_upload_bytes: int = 200 * 1024 * 1024
    max_duration_s: float = 3600.0  # longest file accepted by POST /v1/enhance
    rest_chunk_s: float = 5.0  # decode / enhance / encode block: bounds memory for long files
    # websocket limits
    max_message_bytes: int = 1024 * 1024  # one binary or text message (1009 beyond)
    # a resumable stream's state (sent before 1012, given back in the next start message, which may be
    # this much larger); a stream whose state is larger gets its tail instead
    max_state_bytes: int = 16 * 1024 * 1024
    max_messages_per_s: float = 400.0  # messages per stream per second, bursts up to one second's worth (1008 beyond)
    max_stream_s: float = 4 * 3600.0  # audio one websocket stream may send (1008 beyond)
    idle_timeout_s: float = 30.0  # no message for this long closes the stream (1008)
    max_buffered_s: float = 2.0  # audio accepted ahead of inference before reading pauses
    # on SIGTERM: live streams run on for up to this long, then get their tail and 1012; uploads in flight
    # finish (those still running then get as long again). Also $TIM_ENHANCER_DRAIN_TIMEOUT_S.
    drain_timeout_s: float = 10.0
    agent_port: int | None = None  # HAProxy agent-check port (server.agent); None: no agent. Also $TIM_ENHANCER_AGENT_PORT
    # Unix socket of a step server (server.stepserver) that runs the model for this process and others;
    # None: this process runs it
    step_server: str | None = None
    # the key shared with that step server (required with step_server). Also $TIM_ENHANCER_STEP_KEY
    step_key: str | None = None
    # on a device pool, each round's live step covers the whole pool through one static graph (a CUDA
    # graph under CUDA); also `enhancer serve --full-steps` and $TIM_ENHANCER_FULL_STEPS=1
    full_steps: bool = False
    # keep the streams' state in a device pool on the CPU too (under CUDA it always is);
    # also `enhancer serve --device-pool` and $TIM_ENHANCER_DEVICE_POOL=1
    device_pool: bool = False

    def __post_init__(self):
        if self.workers is None:  # frozen: the resolved default is set once, here
            from server.scheduling.cpus import available_cpus

            one = self.device == "cuda" or self.step_server is not None
            object.__setattr__(self, "workers", 1 if one else available_cpus())

    @classmethod
    def build(cls, **kwargs) -> Settings:
        """Settings from keyword arguments; the API key (or key file), the step server's key, CORS origins, drain timeout and
        agent port may come from the environment ($TIM_ENHANCER_API_KEY, $TIM_ENHANCER_API_KEYS_FILE, $TIM_ENHANCER_STEP_KEY, $TIM_ENHANCER_CORS_ORIGINS (comma-separated),
        $TIM_ENHANCER_DRAIN_TIMEOUT_S, $TIM_ENHANCER_AGENT_PORT); a keyword argument wins."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown setting(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        if "api_key" not in kwargs and os.environ.get(API_KEY_ENV):
            kwargs["api_key"] = os.environ[API_KEY_ENV]
        if "api_keys_file" not in kwargs and os.environ.get(API_KEYS_FILE_ENV):
            kwargs["api_keys_file"] = os.environ[API_KEYS_FILE_ENV]
        if "step_key" not in kwargs and os.environ.get(STEP_KEY_ENV):
            kwargs["step_key"] = os.environ[STEP_KEY_ENV]
        if "cors_origins" not in kwargs and os.environ.get(CORS_ENV):
            kwargs["cors_origins"] = os.environ[CORS_ENV]
        for name, env, parse in (("drain_timeout_s", DRAIN_ENV, float), ("agent_port", AGENT_ENV, int)):
            if name not in kwargs and os.environ.get(env, "").strip():
                try:
                    kwargs[name] = parse(os.environ[env].strip())
                except ValueError:
                    raise ValueError(f"${env} must be a number, got {os.environ[env]!r}") from None
        if isinstance(kwargs.get("cors_origins"), str):
            kwargs["cors_origins"] = tuple(o.strip() for o in kwargs["cors_origins"].split(",") if o.strip())
        elif "cors_origins" in kwargs:
            kwargs["cors_origins"] = tuple(kwargs["cors_origins"])
        for name in ("model", "api_keys_file", "ssl_certfile", "ssl_keyfile"):
            if name in kwargs and isinstance(kwargs[name], (str, os.PathLike)):
                kwargs[name] = Path(kwargs[name])
        s = cls(**kwargs)
        s.validate()
        return s

    def validate(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        for name in ("workers", "threads", "max_streams", "max_rest_jobs", "max_channels", "max_upload_bytes",
                     "max_message_bytes", "max_state_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.max_channels > MAX_CHANNELS:
            raise ValueError(f"max_channels must be <= {MAX_CHANNELS}, got {self.max_channels}")
        for name in ("max_duration_s", "rest_chunk_s", "max_stream_s", "idle_timeout_s", "max_buffered_s",
                     "drain_timeout_s", "max_messages_per_s", "capacity_raise_s", "capacity_lower_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"{name} must be a number > 0, got {v!r}")
        if self.capacity is not None and (not isinstance(self.capacity, int) or isinstance(self.capacity, bool)
                                          or self.capacity < 1):
            raise ValueError(f"capacity must be an integer >= 1 or None (measure it), got {self.capacity!r}")
        if not isinstance(self.loop_ms, (int, float)) or isinstance(self.loop_ms, bool) or not 0 <= self.loop_ms < 16:
            raise ValueError(f"loop_ms must be a number in [0, 16), got {self.loop_ms!r}")
        if not isinstance(self.capacity_margin, (int, float)) or not 0 <= self.capacity_margin < 1:
            raise ValueError(f"capacity_margin must be a number in [0, 1), got {self.capacity_margin!r}")
        for name in ("lateness_budget_ms", "max_lateness_ms"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"{name} must be a number > 0, got {v!r}")
        if self.max_lateness_ms < self.lateness_budget_ms:
            raise ValueError(f"max_lateness_ms ({self.max_lateness_ms:g}) must be >= lateness_budget_ms "
                             f"({self.lateness_budget_ms:g})")
        if not isinstance(self.max_batch_wait_ms, (int, float)) or not 0 <= self.max_batch_wait_ms <= 16:
            raise ValueError(f"max_batch_wait_ms must be a number in 0..16, got {self.max_batch_wait_ms!r}")
        if self.agent_port is not None and (not isinstance(self.agent_port, int) or isinstance(self.agent_port, bool)
                                            or not 1 <= self.agent_port <= 65535):
            raise ValueError(f"agent_port must be a TCP port (1-65535) or None, got {self.agent_port!r}")
        if self.step_server is not None and (not isinstance(self.step_server, str) or not self.step_server.strip()):
            raise ValueError(f"step_server must be the path of a step server's Unix socket, got {self.step_server!r}")
        if self.step_server is not None and not self.step_key:
            raise ValueError(f"step_server needs step_key, the key shared with the step server: --step-key-file PATH "
                             f"or ${STEP_KEY_ENV}")
        for name in ("full_steps", "device_pool"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.capacity_follow, bool):
            raise ValueError(f"capacity_follow must be true or false, got {self.capacity_follow!r}")
        if self.api_key is not None and not str(self.api_key).strip():
            raise ValueError("api_key is empty; omit it to disable authentication")
        if self.api_key is not None and self.api_keys_file is not None:
            raise ValueError(f"api_key and api_keys_file are both set: give one (the key file holds any number of keys; "
                             f"unset ${API_KEY_ENV} or ${API_KEYS_FILE_ENV})")
        for name in ("api_keys_file", "ssl_certfile", "ssl_keyfile"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), Path):
                raise ValueError(f"{name} must be a path, got {getattr(self, name)!r}")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile and ssl_keyfile go together: give both (TLS) or neither")

    @property
    def lanes_per_worker(self) -> int:
        """Lanes (one per channel) each worker's pool holds: every mono stream plus every REST job
        at the widest channel count fit on any one worker. Wider streams use the same budget."""
        return self.max_streams + self.max_channels * self.max_rest_jobs

    def public(self) -> dict:
        """The limits a client may see (no secrets)."""
        keep = ("max_streams", "max_channels", "lateness_budget_ms", "max_lateness_ms", "max_upload_bytes", "max_duration_s", "max_message_bytes",
                "max_state_bytes", "max_messages_per_s", "max_stream_s", "idle_timeout_s")
        return {k: getattr(self, k) for k in keep} | {"auth": self.api_key is not None or self.api_keys_file is not None}
