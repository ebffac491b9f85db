"""A live stream's state as bytes, so that another process continues it exactly
(`StreamCursor.state_bytes`, `StreamCursor.load_state_bytes`).

A service that restarts hands each stream's state to its client, which gives it to the next
replica: the stream then goes on as if nothing had happened (the output equals an uninterrupted
run's). The state is a tree of dicts whose leaves are numpy arrays, ints, floats, bools or None
(each class's `state()`); it travels as an .npz archive (numpy's zip of .npy files, read without
pickle) with one entry per leaf, named by its path and type, and a JSON `meta` entry that says
whose stream it is (the model, rate, channels, options, samples in and out).

A state comes back from a client, so it is checked before it is used: the same leaves, of the same
types, dtypes and trailing shapes, as the fresh stream's own state; finite floats; bounded sizes.
"""
from __future__ import annotations

import io
import json
import zipfile

import numpy as np

from .errors import StateError
from .step_io import lane_shapes

FORMAT = 2  # 2: the stream resamplers keep the input from the first sample their next output takes
TAGS = {"a": "array", "i": "int", "f": "float", "b": "bool", "n": "none"}
MAX_INT = 1 << 53
MAX_ROWS = 1 << 26  # rows of one array, at most


def _tag(value) -> str:
    if value is None:
        return "n"
    if isinstance(value, (bool, np.bool_)):
        return "b"
    if isinstance(value, (int, np.integer)):
        return "i"
    if isinstance(value, (float, np.floating)):
        return "f"
    if isinstance(value, np.ndarray):
        return "a"
    raise TypeError(f"a stream state leaf cannot be {type(value).__name__}")


def flatten(state: dict, prefix: str = "") -> dict[str, np.ndarray]:
    """{"path|tag": array} of every leaf of the tree `state`."""
    out = {}
    for key, value in state.items():
        if "|" in key or "." in key:
            raise ValueError(f"state key {key!r} contains '|' or '.'")
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, path + "."))
            continue
        tag = _tag(value)
        out[f"{path}|{tag}"] = np.zeros(0, np.uint8) if tag == "n" else np.asarray(value)
    return out


def unflatten(arrays: dict[str, np.ndarray]) -> dict:
    """The tree of `flatten`, leaves back to their Python types."""
    tree: dict = {}
    for name, a in arrays.items():
        path, _, tag = name.rpartition("|")
        node = tree
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = {"n": lambda _: None, "i": lambda x: int(x), "f": lambda x: float(x), "b": lambda x: bool(x),
                      "a": lambda x: x}[tag](a)
    return tree


def check_like(given: dict[str, np.ndarray], template: dict[str, np.ndarray]) -> None:
    """StateError unless the flattened `given` has the leaves of the flattened `template`: the same
    paths; the same types (None and an array may stand for each other: buffers made on first use);
    arrays of the same dtype, rank and trailing shape, at most MAX_ROWS rows, finite if float;
    finite floats; ints below MAX_INT in size."""
    def split(d):
        return {name.rpartition("|")[0]: (name.rpartition("|")[2], a) for name, a in d.items()}

    g, t = split(given), split(template)
    if set(g) != set(t):
        extra, missing = sorted(set(g) - set(t)), sorted(set(t) - set(g))
        raise StateError(f"the state does not fit this stream (unknown: {extra[:4]}, missing: {missing[:4]})")
    for path, (tag, a) in g.items():
        want, ref = t[path]
        if tag not in TAGS or (tag != want and {tag, want} != {"a", "n"}):
            raise StateError(f"state {path!r} holds a {TAGS.get(tag, tag)}, expected: {TAGS[want]}")
        if tag == "a" and want == "a" and (a.dtype != ref.dtype or a.ndim != ref.ndim or a.shape[1:] != ref.shape[1:]):
            raise StateError(f"state {path!r} is {a.dtype}{list(a.shape)}, expected {ref.dtype}[n, {', '.join(map(str, ref.shape[1:]))}]"
                             if ref.ndim else f"state {path!r} is {a.dtype}{list(a.shape)}, expected a {ref.dtype} scalar")
        if tag == "a" and a.dtype.kind not in "biuf":
            raise StateError(f"state {path!r} has dtype {a.dtype}")
        if tag == "a" and a.ndim and a.shape[0] > MAX_ROWS:
            raise StateError(f"state {path!r} has {a.shape[0]} rows, at most {MAX_ROWS}")
        if tag in "if" and a.shape != ():
            raise StateError(f"state {path!r} is not a scalar")
        if (tag in "af" and a.dtype.kind == "f" and not np.isfinite(a).all()) or (tag == "i" and abs(int(a)) >= MAX_INT):
            raise StateError(f"state {path!r} holds a value out of range")


def pack(meta: dict, state: dict) -> bytes:
    """The archive of `state` with `meta` (a JSON object)."""
    arrays = flatten(state)
    arrays["meta"] = np.frombuffer(json.dumps(meta, sort_keys=True).encode(), np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _read(blob: bytes, names=None) -> tuple[dict, dict[str, np.ndarray]]:
    """(meta, the other entries) of an archive, only `meta` and `names` if given; StateError when it
    is not readable or its meta is not a JSON object."""
    try:
        with np.load(io.BytesIO(blob), allow_pickle=False) as z:
            arrays = {name: z[name] for name in (z.files if names is None else ["meta", *names])}
        meta = json.loads(arrays.pop("meta").tobytes().decode())
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, UnicodeDecodeError, RecursionError) as e:
        raise StateError(f"the stream state is not readable ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict):
        raise StateError("the stream state's meta is not an object")
    return meta, arrays


def unpack(blob: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """(meta, flattened state) of an archive; StateError when it is not one of `pack`'s."""
    meta, arrays = _read(blob)
    if meta.get("format") != FORMAT:
        raise StateError(f"stream state format {meta.get('format')!r}, this version reads {FORMAT}")
    for name in arrays:
        if name.rpartition("|")[2] not in TAGS:
            raise StateError(f"the stream state has an unknown entry {name!r}")
    return meta, arrays


def peek(blob: bytes) -> dict:
    """Only the meta of an archive, whatever its format version (StateError as `_read`)."""
    return _read(blob, [])[0]


def attrs_state(obj, names) -> dict:
    """{name: value} of `obj`'s attributes `names`; an attribute with a `state()` gives its own tree."""
    out = {}
    for name in names:
        v = getattr(obj, name)
        out[name.lstrip("_")] = v.state() if hasattr(v, "state") and hasattr(v, "load_state") else v
    return out


def load_attrs(obj, names, state: dict) -> None:
    """The inverse of `attrs_state`: each attribute set (or, with a `load_state`, loaded)."""
    for name in names:
        v, new = getattr(obj, name), state[name.lstrip("_")]
        if hasattr(v, "state") and hasattr(v, "load_state"):
            v.load_state(new)
        else:
            setattr(obj, name, new)


class StreamState:
    """`StreamCursor`'s hand-off: its whole state as an archive (`state_bytes`) and a fresh cursor
    continued from one (`load_state_bytes`)."""

    def _meta(self) -> dict:
        return {"format": FORMAT, "model": self.engine.identity, "sample_rate": self.sample_rate,
                "channels": self.channels, "band": self.band, "level": self.level, "min_gain": float(self.min_gain)}

    def _state(self, lanes: dict) -> dict:
        ready = np.concatenate(self._ready) if self._ready else np.zeros((0, self.channels), np.float32)
        return {"n_in": self.n_in, "n_in_model": self.n_in_model, "n_out": self.n_out, "hops_out": self.hops_out,
                "skipped": self.skipped, "to_drop": self._to_drop, "pending": self._pending,
                "ready": ready.astype(np.float32, copy=False), "rs_in": self._rs_in.state(), "rs_out": self._rs_out.state(),
                "high": self._high.state() if self._high is not None else None,
                "level": self._level.state() if self._level is not None else None, "lanes": lanes}

    def state_bytes(self) -> bytes:
        """The stream's whole state (`enhancer.handoff`): a cursor of another process, on an engine
        of the same model and with the same parameters, continues it from `load_state_bytes`
        exactly as this one would (`input_samples` and `output_samples` of the meta tell where the
        input and the output go on). Call it between calls of the pool, after `pull`."""
        self._check_open()
        meta = self._meta() | {"input_samples": self.n_in, "output_samples": self.n_out}
        return pack(meta, self._state(self.pool.export_lanes(self.lanes)))

    def check_state_meta(self, meta: dict) -> None:
        """StateError unless a state's meta (`enhancer.handoff.peek`) is of this model and stream."""
        mine = self._meta()
        for key, want in mine.items():
            got = meta.get(key)
            if key == "min_gain" and isinstance(got, (int, float)) and abs(got - want) <= 1e-9 * max(abs(want), 1e-30):
                continue
            if got != want:
                what = "model" if key == "model" else f"stream's {key}"
                raise StateError(f"the state is of another {what} ({got!r}; this one: {want!r})")

    def load_state_bytes(self, blob: bytes) -> dict:
        """Continue the stream whose `state_bytes` these are (a fresh cursor only). Returns the
        state's meta; StateError (and the cursor fresh again) when it is not a state of this
        model and stream."""
        self._check_open()
        meta, arrays = unpack(blob)
        self.check_state_meta(meta)
        shapes = lane_shapes(self.engine, self.channels)
        template = flatten(self._state({name: np.zeros(shape, dtype) for name, (shape, dtype) in shapes.items()}))
        check_like(arrays, template)
        st = unflatten(arrays)
        try:
            self.pool.import_lanes(self.lanes, st["lanes"])
            self.n_in, self.n_in_model, self.n_out = st["n_in"], st["n_in_model"], st["n_out"]
            self.hops_out, self.skipped, self._to_drop = st["hops_out"], st["skipped"], st["to_drop"]
            self._pending, self._ready = st["pending"], [st["ready"]] if len(st["ready"]) else []
            self._rs_in.load_state(st["rs_in"])
            self._rs_out.load_state(st["rs_out"])
            if self._high is not None:
                self._high.load_state(st["high"])
            if self._level is not None:
                self._level.load_state(st["level"])
        except (ValueError, KeyError, IndexError, TypeError) as e:
            self.reset()
            raise StateError(f"the state does not fit this stream: {e}") from None
        return meta
