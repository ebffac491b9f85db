"""The API key file (`enhancer serve --api-keys FILE`, $TIM_ENHANCER_API_KEYS_FILE): TOML or JSON,
one entry per key, each with a name and its own limits (server/README.md, "API keys").

    removed_streams = "finish"        # streams of a key removed at a reload: "finish" or "close"

    [[keys]]
    name = "app-a"                    # metrics label and log name: letters, digits, . _ -
    key = "sha256:9f86d0...0f00a08"   # the SHA-256 of the key (hex), or the key itself (16+ characters)
    max_streams = 4                   # live streams at once (omit: the server's capacity only)
    requests_per_minute = 60          # POST /v1/enhance requests (a bucket of a minute's worth)
    max_upload_s = 600                # seconds of audio per upload (at most the server's max_duration_s)

    [[keys]]
    name = "ops"
    keys = ["sha256:...", "sha256:..."]   # several keys of one name (rotation: old and new together)
    admin = true                          # may read /metrics and POST /v1/admin/reload

JSON: the same fields, `{"removed_streams": "finish", "keys": [{"name": ..., "key": ...}, ...]}`.
Keys are kept only as SHA-256 digests (`KeyRing` holds no key); a malformed file is refused with
the line at fault named (`KeyFileError`), and the keys in force stay.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from enhancer.errors import EnhancerError

try:
    import tomllib
except ImportError:  # pragma: no cover - Python 3.10
    try:
        import tomli as tomllib
    except ImportError:
        tomllib = None

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
HASH_PREFIX = "sha256:"
MIN_PLAIN_KEY = 16  # characters of a key written in the file as itself
REMOVED_STREAMS = ("finish", "close")
TOP_FIELDS = ("keys", "removed_streams")
KEY_FIELDS = ("name", "key", "keys", "admin", "max_streams", "requests_per_minute", "max_upload_s")


class KeyFileError(EnhancerError, ValueError):
    """The key file cannot be read or is malformed; the message names the file and the line."""


def digest(key: str) -> bytes:
    """The SHA-256 digest a key is stored and compared as."""
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class ApiKey:
    """One name of the key file: its keys' digests and its limits (None: no limit of its own)."""

    name: str
    digests: tuple[bytes, ...] = field(repr=False)
    admin: bool = False
    max_streams: int | None = None
    requests_per_minute: float | None = None
    max_upload_s: float | None = None


@dataclass(frozen=True)
class KeyRing:
    """The keys in force: from the key file, or the single `--api-key` (name `default`, admin)."""

    keys: tuple[ApiKey, ...]
    removed_streams: str = "finish"

    @classmethod
    def single(cls, key: str) -> KeyRing:
        return cls((ApiKey("default", (digest(key),), admin=True),))

    def find(self, given: str) -> tuple[ApiKey | None, bytes]:
        """The entry whose key is `given` (or None) and `given`'s digest. Every stored digest is
        compared with `hmac.compare_digest`, with no early exit: the time taken does not depend on
        which entry matches or how much of a digest does."""
        d, found = digest(given), None
        for entry in self.keys:
            for stored in entry.digests:
                if hmac.compare_digest(stored, d):
                    found = entry
        return found, d

    def get(self, name: str) -> ApiKey | None:
        return next((k for k in self.keys if k.name == name), None)

    @property
    def names(self) -> list[str]:
        return [k.name for k in self.keys]

    @property
    def digests(self) -> frozenset[bytes]:
        return frozenset(d for k in self.keys for d in k.digests)


def load_key_file(path: Path) -> KeyRing:
    """The key ring of the file at `path`, or KeyFileError naming the file and the line at fault."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise KeyFileError(f"{path.name}: cannot read the key file ({(e.strerror or str(e)).lower()})") from None
    except UnicodeDecodeError as e:
        raise KeyFileError(f"{path.name}: the key file is not UTF-8 text (byte {e.start})") from None
    fmt = {".json": "json", ".toml": "toml"}.get(path.suffix.lower())
    if fmt is None:
        fmt = "json" if text.lstrip().startswith("{") else "toml"
    doc = _parse(text, fmt, path.name)
    return _Checker(text, fmt, path.name).ring(doc)


def _parse(text: str, fmt: str, name: str) -> dict:
    if fmt == "json":
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise KeyFileError(f"{name} line {e.lineno}, column {e.colno}: malformed JSON: {e.msg}") from None
        except RecursionError:
            raise KeyFileError(f"{name}: malformed JSON: nested too deeply") from None
        if not isinstance(doc, dict):
            raise KeyFileError(f"{name} line 1: the key file must be a JSON object with a \"keys\" array")
        return doc
    if tomllib is None:  # pragma: no cover - Python 3.10 without tomli
        raise KeyFileError(f"{name}: TOML key files need Python 3.11 or the tomli package; write the file as JSON")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        msg = str(e)
        where = re.search(r"\(at line (\d+), column (\d+)\)", msg)
        if where:
            msg = msg[:where.start()].strip()
            raise KeyFileError(f"{name} line {where[1]}, column {where[2]}: malformed TOML: {msg}") from None
        raise KeyFileError(f"{name}: malformed TOML: {msg}") from None


class _Checker:
    """Validates a parsed key file; each error names the line of the field (or entry) at fault."""

    def __init__(self, text: str, fmt: str, name: str):
        self.text, self.fmt, self.name = text, fmt, name
        self.starts: list[int] = []

    def ring(self, doc: dict) -> KeyRing:
        for k in doc:
            if k not in TOP_FIELDS:
                self.fail(None, k, f"unknown field {k!r} (known: {', '.join(TOP_FIELDS)})")
        removed = doc.get("removed_streams", "finish")
        if removed not in REMOVED_STREAMS:
            self.fail(None, "removed_streams", f"removed_streams must be \"finish\" or \"close\", got {removed!r}")
        entries = doc.get("keys")
        if not isinstance(entries, list) or not entries:
            self.fail(None, "keys", "the key file needs at least one key: a [[keys]] table (TOML) or a \"keys\" "
                      "array (JSON) of entries with a name and a key")
        self.starts = self._entry_starts(len(entries))
        keys, names, seen = [], {}, {}
        for i, entry in enumerate(entries):
            k = self.entry(i, entry)
            if k.name in names:
                self.fail(i, "name", f"the name {k.name!r} is used by key entry {names[k.name] + 1} too")
            names[k.name] = i
            for d in k.digests:
                if d in seen:
                    self.fail(i, "key" if "key" in entry else "keys", f"this key is also key entry {seen[d] + 1}'s "
                              f"({keys[seen[d]].name!r}): each key belongs to one name")
                seen[d] = i
            keys.append(k)
        return KeyRing(tuple(keys), removed)

    def entry(self, i: int, entry) -> ApiKey:
        if not isinstance(entry, dict):
            self.fail(i, None, "each key entry must be a table (TOML [[keys]]) or an object (JSON)")
        for k in entry:
            if k not in KEY_FIELDS:
                self.fail(i, k, f"unknown field {k!r} (known: {', '.join(KEY_FIELDS)})")
        name = entry.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            self.fail(i, "name", "name must be 1-64 letters, digits, '.', '_' or '-' (starting with a letter or "
                      f"digit), got {name!r}")
        if ("key" in entry) == ("keys" in entry):
            self.fail(i, "key" if "key" in entry else None, "each entry needs either key = \"...\" or keys = [...]")
        given = [entry["key"]] if "key" in entry else entry["keys"]
        where = "key" if "key" in entry else "keys"
        if not isinstance(given, list) or not given:
            self.fail(i, where, "keys must be a non-empty list of keys")
        digests = tuple(self.key_digest(i, where, k) for k in given)
        admin = entry.get("admin", False)
        if not isinstance(admin, bool):
            self.fail(i, "admin", f"admin must be true or false, got {admin!r}")
        return ApiKey(name, digests, admin, self.number(i, entry, "max_streams", integer=True),
                      self.number(i, entry, "requests_per_minute"), self.number(i, entry, "max_upload_s", zero=False))

    def key_digest(self, i: int, where: str, key) -> bytes:
        """A key's digest; the key's value never appears in an error."""
        if not isinstance(key, str):
            self.fail(i, where, f"a key must be a string, got {type(key).__name__}")
        if key.lower().startswith(HASH_PREFIX):
            hexdigest = key[len(HASH_PREFIX):]
            if not re.fullmatch(r"[0-9A-Fa-f]{64}", hexdigest):
                self.fail(i, where, "a sha256: key must be followed by 64 hex digits (the SHA-256 of the key, e.g. "
                          "printf %s KEY | sha256sum)")
            return bytes.fromhex(hexdigest)
        if len(key) < MIN_PLAIN_KEY or key != key.strip():
            self.fail(i, where, f"a key must have at least {MIN_PLAIN_KEY} characters and no surrounding spaces "
                      "(e.g. openssl rand -base64 32), or be written as sha256:<hex digest>")
        return digest(key)

    def number(self, i: int, entry: dict, name: str, integer: bool = False, zero: bool = True):
        v = entry.get(name)
        if v is None:
            return None
        ok = isinstance(v, int) if integer else isinstance(v, (int, float)) and v == v and v != float("inf")
        if isinstance(v, bool) or not ok or v < 0 or (v == 0 and not zero):
            what = "an integer" if integer else "a number"
            self.fail(i, name, f"{name} must be {what} {'>= 0' if zero else '> 0'}, got {v!r}")
        return v

    def fail(self, i: int | None, field_name: str | None, message: str):
        line = self._line(i, field_name)
        entry = "" if i is None else f"key entry {i + 1}: "
        raise KeyFileError(f"{self.name}{f' line {line}' if line else ''}: {entry}{message}")

    # --------------------------------------------------------------- where things are in the text
    def _line_of(self, offset: int) -> int:
        return self.text.count("\n", 0, offset) + 1

    def _entry_starts(self, count: int) -> list[int]:
        """Offsets of the key entries in the text ([] when they cannot be told apart)."""
        if self.fmt == "toml":
            starts = [m.start() for m in re.finditer(r"^[ \t]*\[\[[ \t]*keys[ \t]*\]\]", self.text, re.M)]
            return starts if len(starts) == count else []
        m = re.search(r'"keys"\s*:\s*\[', self.text)
        starts, pos, decoder = [], m.end() if m else 0, json.JSONDecoder()
        try:
            while m and len(starts) < count:
                while self.text[pos] in " \t\r\n,":
                    pos += 1
                starts.append(pos)
                _, pos = decoder.raw_decode(self.text, pos)
        except (ValueError, IndexError):
            return []
        return starts

    def _line(self, i: int | None, field_name: str | None) -> int | None:
        if i is not None and i >= len(self.starts):
            return None
        start = 0 if i is None else self.starts[i]
        end = self.starts[i + 1] if i is not None and i + 1 < len(self.starts) else len(self.text)
        if i is None and self.starts and self.fmt == "toml":
            end = self.starts[0]  # top-level fields come before the first [[keys]]
        if field_name is not None:
            pattern = (rf'"{re.escape(field_name)}"\s*:' if self.fmt == "json"
                       else rf'^[ \t]*"?{re.escape(field_name)}"?[ \t]*=')
            m = re.compile(pattern, re.M).search(self.text, start, end)
            if m:
                return self._line_of(m.start())
            if i is None and field_name == "keys" and self.fmt == "toml":
                return None
        return self._line_of(start) if i is not None else None
