"""The step server's wire format: framed binary messages over a Unix stream socket (no pickle).

A frame is a fixed header followed by a body (all integers little-endian):

    header (20 bytes)  magic b"TSTP", version u8, kind u8, arrays u16, request id u32,
                       meta bytes u32, body bytes u32
    body               one descriptor per array (28 bytes each: dtype code u8, ndim u8, 2 zero
                       bytes, six u32 dims, the unused ones 0), then the meta (a UTF-8 JSON object:
                       the scalars of the message; no bytes when it has none), zero bytes up
                       to a multiple of 8, then each
                       array's C-order bytes, each followed by zero bytes up to a multiple of 8

Dtype codes: 1 float32, 2 int64, 3 int32, 4 float64, 5 float16, 6 uint8, 7 int8.
The body's length must be exactly what its descriptors and meta add up to. Decoding checks
everything (magic, version, kind, counts and lengths against the limits, dtype codes, dims) and
raises `ProtocolError` (a `ValueError`) on anything else. Arrays decode as views of the frame's
buffer (no copy).

Requests and their replies (a reply carries its request's id):

    HELLO                      -> OK, meta: the step server's description (model config, lanes, ...)
    ALLOC, meta {"n": n}       -> OK, arrays: lanes (n,) int64
    FREE / RESET, lanes (k,)   -> OK
    RUN, lanes (k,) int64, hops (k, T, hop) float32, gains (k,) float32
                               -> RESULT, meta {"arrays": the StepResult fields sent, in order},
                                  arrays: out, [competition], activity
    EXPORT, lanes (k,)         -> OK, the lanes' state (`export_lanes`' arrays) packed (`pack_state`):
                                  meta {"names": [...], "shapes": [[k, ...], ...], "dtypes": [code, ...]},
                                  arrays: per dtype (in the order they first come in "dtypes"), its
                                  arrays raveled and concatenated in the order of "names" (1-D)
    IMPORT, lanes (k,), then a packed state as EXPORT's reply, its meta too
                               -> OK (`import_lanes`; a state that does not unpack to the model's
                                  arrays is an ERROR reply, as a failed call)
    any request                -> ERROR, meta {"error": message} when it fails

CHALLENGE, PROOF, WELCOME and ERROR also make up the handshake (`auth`).
"""
from __future__ import annotations

import json
import math
import select
import socket
import struct
import time
from dataclasses import dataclass, field

import numpy as np

from enhancer.engine import StepResult

MAGIC, VERSION = b"TSTP", 1
HEADER = struct.Struct("<4sBBHIII")  # magic, version, kind, arrays, request id, meta bytes, body bytes
MAX_NDIM = 6
ARRAY = struct.Struct(f"<BB2x{MAX_NDIM}I")  # dtype code, ndim, dims
MAX_ARRAYS = 8
MAX_META = 64 * 1024
MAX_MESSAGE = 256 * 1024 * 1024  # the body of one frame, at most
ALIGN = 8

CHALLENGE, PROOF, WELCOME, HELLO, ALLOC, FREE, RESET, RUN, OK, RESULT, ERROR, EXPORT, IMPORT = range(1, 14)
KINDS = {CHALLENGE: "challenge", PROOF: "proof", WELCOME: "welcome", HELLO: "hello", ALLOC: "alloc", FREE: "free",
         RESET: "reset", RUN: "run", OK: "ok", RESULT: "result", ERROR: "error", EXPORT: "export", IMPORT: "import"}
REQUESTS = {HELLO, ALLOC, FREE, RESET, RUN, EXPORT, IMPORT}
DTYPES = {1: np.dtype("<f4"), 2: np.dtype("<i8"), 3: np.dtype("<i4"), 4: np.dtype("<f8"), 5: np.dtype("<f2"),
          6: np.dtype("u1"), 7: np.dtype("i1")}
CODES = {dt: code for code, dt in DTYPES.items()}
RESULT_FIELDS = ("out", "competition", "activity")
# the most bytes of packed lane state one message can carry (the rest of MAX_MESSAGE: descriptors, meta, padding)
MAX_STATE = MAX_MESSAGE - MAX_META - MAX_ARRAYS * (ARRAY.size + 2 * ALIGN)


class ProtocolError(ValueError):
    """A frame that is not a well-formed message of this protocol."""


@dataclass
class Message:
    kind: int
    request: int = 0  # a request's id; its reply carries the same
    meta: dict = field(default_factory=dict)
    arrays: tuple = ()


@dataclass(frozen=True)
class Header:
    kind: int
    arrays: int
    request: int
    meta_len: int
    body_len: int


def _pad(n: int) -> int:
    return -n % ALIGN


def encode(msg: Message) -> list:
    """The frame of `msg` as a list of buffers to send in order (the arrays' own memory, no copy)."""
    if msg.kind not in KINDS:
        raise ProtocolError(f"unknown message kind {msg.kind}")
    if len(msg.arrays) > MAX_ARRAYS:
        raise ProtocolError(f"{len(msg.arrays)} arrays in one message (at most {MAX_ARRAYS})")
    meta = json.dumps(msg.meta, separators=(",", ":")).encode() if msg.meta else b""
    if len(meta) > MAX_META:
        raise ProtocolError(f"meta of {len(meta)} bytes (at most {MAX_META})")
    descriptors, data = [], []
    for a in msg.arrays:
        a = np.asarray(a)
        code = CODES.get(a.dtype)
        if code is None:
            raise ProtocolError(f"dtype {a.dtype} cannot be sent (allowed: {', '.join(map(str, CODES))})")
        if a.ndim > MAX_NDIM:
            raise ProtocolError(f"an array of {a.ndim} dimensions (at most {MAX_NDIM})")
        a = a if a.flags.c_contiguous else a.copy(order="C")  # (np.ascontiguousarray makes 0-d arrays 1-d)
        descriptors.append(ARRAY.pack(code, a.ndim, *a.shape, *[0] * (MAX_NDIM - a.ndim)))
        data.append(memoryview(a.reshape(-1).view(np.uint8)))
        data.append(bytes(_pad(a.nbytes)))
    head = b"".join(descriptors) + meta
    body_len = len(head) + _pad(len(head)) + sum(len(d) for d in data)
    if body_len > MAX_MESSAGE:
        raise ProtocolError(f"a message of {body_len} bytes (at most {MAX_MESSAGE})")
    header = HEADER.pack(MAGIC, VERSION, msg.kind, len(msg.arrays), msg.request, len(meta), body_len)
    return [header + head + bytes(_pad(len(head))), *(d for d in data if len(d))]


def frame(msg: Message) -> bytes:
    """The frame of `msg` as one bytes object."""
    return b"".join(encode(msg))


def parse_header(raw, limit: int = MAX_MESSAGE) -> Header:
    """The header at the start of `raw` (HEADER.size bytes), checked; `limit`: the longest body accepted."""
    if len(raw) < HEADER.size:
        raise ProtocolError(f"truncated header ({len(raw)} of {HEADER.size} bytes)")
    magic, version, kind, n_arrays, request, meta_len, body_len = HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r} (not a step server frame)")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version}, this side speaks {VERSION}")
    if kind not in KINDS:
        raise ProtocolError(f"unknown message kind {kind}")
    if n_arrays > MAX_ARRAYS:
        raise ProtocolError(f"{n_arrays} arrays in one message (at most {MAX_ARRAYS})")
    if meta_len > MAX_META:
        raise ProtocolError(f"meta of {meta_len} bytes (at most {MAX_META})")
    if body_len > limit:
        raise ProtocolError(f"a message of {body_len} bytes (at most {limit})")
    if body_len < n_arrays * ARRAY.size + meta_len:
        raise ProtocolError(f"a body of {body_len} bytes cannot hold {n_arrays} array(s) and {meta_len} bytes of meta")
    return Header(kind, n_arrays, request, meta_len, body_len)


def parse_body(h: Header, body) -> Message:
    """The message of header `h` and its body (a bytearray of exactly h.body_len bytes), checked."""
    if len(body) != h.body_len:
        raise ProtocolError(f"truncated body ({len(body)} of {h.body_len} bytes)")
    specs = []
    for i in range(h.arrays):
        code, ndim, *dims = ARRAY.unpack_from(body, i * ARRAY.size)
        if code not in DTYPES:
            raise ProtocolError(f"array {i}: unknown dtype code {code}")
        if ndim > MAX_NDIM or any(dims[ndim:]):
            raise ProtocolError(f"array {i}: bad dimensions (ndim {ndim}, dims {dims})")
        specs.append((DTYPES[code], tuple(dims[:ndim])))
    o = h.arrays * ARRAY.size
    try:
        meta = json.loads(bytes(body[o:o + h.meta_len]).decode()) if h.meta_len else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"meta is not JSON: {e}") from None
    if not isinstance(meta, dict):
        raise ProtocolError(f"meta is a JSON {type(meta).__name__}, not an object")
    o += h.meta_len
    o += _pad(o)
    arrays = []
    for i, (dt, shape) in enumerate(specs):
        count = math.prod(shape)
        nbytes = count * dt.itemsize
        if o + nbytes > len(body):
            raise ProtocolError(f"array {i}: shape {shape} of {dt} needs {nbytes} bytes, {max(0, len(body) - o)} left")
        arrays.append(np.frombuffer(body, dtype=dt, count=count, offset=o).reshape(shape))
        o += nbytes + _pad(nbytes)
    if o != len(body):
        raise ProtocolError(f"body of {len(body)} bytes, its arrays and meta take {o}")
    return Message(h.kind, h.request, meta, tuple(arrays))


def decode(raw, limit: int = MAX_MESSAGE) -> Message:
    """The message of one whole frame `raw`, checked (ProtocolError if it is not exactly one frame)."""
    h = parse_header(raw, limit)
    if len(raw) != HEADER.size + h.body_len:
        what = "truncated" if len(raw) < HEADER.size + h.body_len else "trailing bytes after"
        raise ProtocolError(f"{what} frame ({len(raw)} bytes, the header says {HEADER.size + h.body_len})")
    return parse_body(h, bytearray(raw[HEADER.size:]))


# sockets

def send(sock: socket.socket, msg: Message, timeout: float) -> None:
    """Send `msg` whole within `timeout` seconds, on a blocking or a non-blocking socket
    (TimeoutError beyond; OSError if the peer went away)."""
    deadline = time.monotonic() + timeout
    nonblocking = sock.gettimeout() == 0.0
    for buf in encode(msg):
        view = memoryview(buf).cast("B")
        while len(view):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"could not send a {KINDS[msg.kind]} message in {timeout:g} s")
            try:
                if not nonblocking:
                    sock.settimeout(left)
                view = view[sock.send(view):]
            except BlockingIOError:
                select.select([], [sock], [], left)


def _recv_exact(sock: socket.socket, buf: bytearray, deadline: float) -> None:
    view, got = memoryview(buf), 0
    while got < len(buf):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no answer in time")
        sock.settimeout(left)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionResetError("the connection closed")
        got += n


def recv(sock: socket.socket, timeout: float, limit: int = MAX_MESSAGE) -> Message:
    """The next message on a blocking socket, read within `timeout` seconds (TimeoutError beyond,
    ConnectionError if the peer closed, ProtocolError if the frame is malformed)."""
    deadline = time.monotonic() + timeout
    head = bytearray(HEADER.size)
    _recv_exact(sock, head, deadline)
    h = parse_header(head, limit)
    body = bytearray(h.body_len)
    _recv_exact(sock, body, deadline)
    return parse_body(h, body)


class Reader:
    """The messages arriving on a non-blocking socket, as they complete (a round loop's reads)."""

    MAX_PER_FEED = 64  # messages one `feed` returns at most (the others wait for the next)

    def __init__(self, sock: socket.socket, limit: int = MAX_MESSAGE):
        self.sock, self.limit = sock, limit
        self._head = bytearray(HEADER.size)
        self._header: Header | None = None
        self._buf = self._head
        self._got = 0

    def feed(self) -> list[Message]:
        """The messages complete now (reads what has arrived, never waits). ConnectionError once the
        peer closed, ProtocolError on a malformed frame."""
        out: list[Message] = []
        while len(out) < self.MAX_PER_FEED:
            if self._got < len(self._buf):
                try:
                    n = self.sock.recv_into(memoryview(self._buf)[self._got:])
                except (BlockingIOError, InterruptedError):
                    return out
                if n == 0:
                    raise ConnectionResetError("the peer closed the connection")
                self._got += n
                if self._got < len(self._buf):
                    continue
            if self._header is None:
                self._header = parse_header(self._head, self.limit)
                self._buf, self._got = bytearray(self._header.body_len), 0
                if self._header.body_len:
                    continue
            out.append(parse_body(self._header, self._buf))
            self._header, self._buf, self._got = None, self._head, 0
        return out


# the requests and replies

def request(kind: str, rid: int, *args) -> Message:
    """The request `kind` ("hello", "alloc" n, "free" lanes, "reset" lanes, "run" lanes hops gains,
    "export" lanes, "import" lanes arrays: `export_lanes`' arrays by name)."""
    if kind == "hello":
        return Message(HELLO, rid)
    if kind == "alloc":
        return Message(ALLOC, rid, {"n": int(args[0])})
    if kind in ("free", "reset", "export"):
        kinds = {"free": FREE, "reset": RESET, "export": EXPORT}
        return Message(kinds[kind], rid, arrays=(np.asarray(args[0], dtype=np.int64),))
    if kind == "import":
        meta, packs = pack_state(args[1])
        return Message(IMPORT, rid, meta, (np.asarray(args[0], dtype=np.int64), *packs))
    if kind == "run":
        lanes, hops, gains = args
        return Message(RUN, rid, arrays=(np.asarray(lanes, dtype=np.int64), np.asarray(hops, dtype=np.float32),
                                         np.asarray(gains, dtype=np.float32)))
    raise ValueError(f"unknown request {kind!r}")


def check_request(msg: Message) -> None:
    """ProtocolError unless `msg` is a request with the arrays and meta its kind takes."""
    if msg.kind not in REQUESTS:
        raise ProtocolError(f"a {KINDS[msg.kind]} message where a request was due")
    want = {HELLO: 0, ALLOC: 0, FREE: 1, RESET: 1, RUN: 3, EXPORT: 1, IMPORT: 1}[msg.kind]
    more = msg.kind == IMPORT  # lanes, then the packs of a state (checked where it is unpacked: `unpack_state`)
    if len(msg.arrays) < want or (len(msg.arrays) > want and not more):
        raise ProtocolError(f"{KINDS[msg.kind]} with {len(msg.arrays)} arrays (takes {want}{' or more' * more})")
    if msg.kind == ALLOC:
        n = msg.meta.get("n")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ProtocolError(f"alloc of {n!r} lanes")
    if msg.arrays and (msg.arrays[0].dtype != np.int64 or msg.arrays[0].ndim != 1):
        raise ProtocolError(f"{KINDS[msg.kind]}: lanes must be (k,) int64, got {msg.arrays[0].shape} "
                            f"{msg.arrays[0].dtype}")
    if msg.kind == RUN:
        k = len(msg.arrays[0])
        _, hops, gains = msg.arrays
        if hops.dtype != np.float32 or hops.ndim != 3 or hops.shape[0] != k or hops.shape[1] < 1:
            raise ProtocolError(f"run: hops must be ({k}, T >= 1, hop) float32, got {hops.shape} {hops.dtype}")
        if gains.dtype != np.float32 or gains.shape != (k,):
            raise ProtocolError(f"run: gains must be ({k},) float32, got {gains.shape} {gains.dtype}")


def ok(rid: int, meta: dict | None = None, arrays: tuple = ()) -> Message:
    return Message(OK, rid, meta or {}, tuple(arrays))


def error(rid: int, text: str) -> Message:
    return Message(ERROR, rid, {"error": str(text)[:4000]})


def result(rid: int, r: StepResult) -> Message:
    """A run's reply: the fields of `r` that are not None."""
    names = [f for f in RESULT_FIELDS if getattr(r, f) is not None]
    return Message(RESULT, rid, {"arrays": names}, tuple(getattr(r, f) for f in names))


def to_result(msg: Message) -> StepResult:
    """The StepResult of a RESULT message (ProtocolError if it is not one)."""
    names = msg.meta.get("arrays")
    if (msg.kind != RESULT or not isinstance(names, list) or len(names) != len(msg.arrays)
            or len(set(names)) != len(names) or not set(names) <= set(RESULT_FIELDS) or "out" not in names):
        raise ProtocolError(f"not a run's result: a {KINDS.get(msg.kind, msg.kind)} message with {msg.meta}")
    fields = dict.fromkeys(RESULT_FIELDS) | dict(zip(names, msg.arrays))
    return StepResult(**fields)


# lane state (EXPORT, IMPORT): the arrays of `export_lanes`, a few dozen, packed into one array per dtype

def pack_state(arrays: dict) -> tuple[dict, tuple]:
    """`export_lanes`' arrays (by name) as (meta, packs): meta {"names", "shapes", "dtypes" (codes)}
    in the arrays' order; packs: per dtype, in the order they first come, its arrays raveled and
    concatenated (1-D)."""
    names, shapes, codes, groups = [], [], [], {}
    for name, a in arrays.items():
        a = np.asarray(a)
        code = CODES.get(a.dtype)
        if code is None:
            raise ProtocolError(f"lane state {name!r}: dtype {a.dtype} cannot be sent")
        names.append(str(name))
        shapes.append(list(a.shape))
        codes.append(code)
        groups.setdefault(code, []).append(a.reshape(-1))
    packs = tuple(np.concatenate(g) if len(g) > 1 else g[0] for g in groups.values())
    return {"names": names, "shapes": shapes, "dtypes": codes}, packs


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 32


def unpack_state(meta: dict, packs) -> dict[str, np.ndarray]:
    """The arrays (by name, views of the packs) of a packed state, checked: ProtocolError unless the
    meta and the packs are exactly what `pack_state` makes of some arrays."""
    names, shapes, codes = (meta.get(key) for key in ("names", "shapes", "dtypes"))
    if not all(isinstance(x, list) for x in (names, shapes, codes)) or not len(names) == len(shapes) == len(codes):
        raise ProtocolError("lane state: the meta needs names, shapes and dtypes, lists of one length")
    if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise ProtocolError("lane state: the names must be distinct strings")
    if not all(_count(c) and c in DTYPES for c in codes):
        raise ProtocolError(f"lane state: unknown dtype codes in {codes[:64]}")
    if not all(isinstance(d, list) and len(d) <= MAX_NDIM and all(_count(n) for n in d) for d in shapes):
        raise ProtocolError(f"lane state: shapes must be lists of at most {MAX_NDIM} dimensions")
    order = list(dict.fromkeys(codes))  # the packs' dtypes
    if len(packs) != len(order) or any(p.ndim != 1 or p.dtype != DTYPES[c] for p, c in zip(packs, order)):
        got = [f"{p.dtype}{list(p.shape)}" for p in packs]
        raise ProtocolError(f"lane state: packs {got}, expected one 1-D array of each of {[str(DTYPES[c]) for c in order]}")
    used = dict.fromkeys(order, 0)
    out = {}
    for name, shape, code in zip(names, shapes, codes):
        pack, n = packs[order.index(code)], math.prod(shape)
        if used[code] + n > len(pack):
            raise ProtocolError(f"lane state {name!r}: shape {shape} runs past its pack of {len(pack)}")
        out[name] = pack[used[code]:used[code] + n].reshape(shape)
        used[code] += n
    if any(used[c] != len(p) for p, c in zip(packs, order)):
        raise ProtocolError("lane state: its packs hold more than its arrays")
    return out


def lane_state(rid: int, arrays: dict) -> Message:
    """An EXPORT's reply: OK with `arrays` packed."""
    meta, packs = pack_state(arrays)
    return Message(OK, rid, meta, packs)


def to_lane_state(msg: Message) -> dict[str, np.ndarray]:
    """The arrays of an EXPORT's reply (ProtocolError if it is not one) or of an IMPORT request."""
    if msg.kind not in (OK, IMPORT):
        raise ProtocolError(f"not a lane state: a {KINDS.get(msg.kind, msg.kind)} message")
    return unpack_state(msg.meta, msg.arrays[1:] if msg.kind == IMPORT else msg.arrays)
