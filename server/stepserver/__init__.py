"""The step server: one process that owns the accelerator and steps the live streams of several
service processes (`enhancer step-server`), and the lane pool the front-ends step through it.
`wire`: the framed binary messages; `auth`: the shared-key handshake."""
from .pool import RemoteLanePool, StepServerError
from .server import StepServer, add_arguments, main, run

__all__ = ["RemoteLanePool", "StepServer", "StepServerError", "add_arguments", "main", "run"]
