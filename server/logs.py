"""Logging set-up for uvicorn: the same format, with API keys in query strings redacted; the service's
own logger (`tim_enhancer`: start-up, capacity and its changes, refusals, the drain) at INFO on the
same handler (without it, Python's last-resort handler shows warnings only)."""
from __future__ import annotations

import copy
import logging
import re

_KEY = re.compile(r"(api_key=)[^&\s\"']+", re.IGNORECASE)


class RedactApiKey(logging.Filter):
    """Replaces `api_key=<secret>` in log messages (uvicorn logs websocket paths with their query)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.args:
            args = record.args if isinstance(record.args, tuple) else (record.args,)
            record.args = tuple(_KEY.sub(r"\1***", a) if isinstance(a, str) else a for a in args)
        if isinstance(record.msg, str):
            record.msg = _KEY.sub(r"\1***", record.msg)
        return True


def log_config() -> dict:
    from uvicorn.config import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    cfg.setdefault("filters", {})["redact_api_key"] = {"()": RedactApiKey}
    for handler in cfg["handlers"].values():
        handler.setdefault("filters", []).append("redact_api_key")
    # propagate: a handler on the root logger (pytest's caplog, an embedding application's) sees it too
    cfg["loggers"]["tim_enhancer"] = {"handlers": ["default"], "level": "INFO", "propagate": True}
    return cfg
