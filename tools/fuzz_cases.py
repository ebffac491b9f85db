"""Hypothesis strategies for fuzzing the service: uploads (containers, rates, channels, subtypes,
special sample values, truncation, corrupted headers, junk with audio magic numbers, odd content
types and multipart forms) and websocket sessions (start messages, payload sizes and alignment,
message order, text/binary mix-ups, protocol violations, abrupt ends).

A case is plain data (dataclasses); `encode_upload` turns an upload case into bytes. Audio is
made from a seed with numpy, so that hypothesis only draws small parameters.
"""
from __future__ import annotations

import io
import json
import struct
from dataclasses import dataclass, field

import numpy as np
import soundfile as sf
from hypothesis import strategies as st

# (container, subtypes libsndfile writes for it)
CONTAINERS = {
    "WAV": ["PCM_16", "PCM_24", "PCM_32", "PCM_U8", "FLOAT", "DOUBLE", "ULAW", "ALAW", "IMA_ADPCM", "MS_ADPCM"],
    "FLAC": ["PCM_16", "PCM_24", "PCM_S8"],
    "OGG": ["VORBIS", "OPUS"],
    "AIFF": ["PCM_16", "PCM_24", "FLOAT"],
    "AU": ["PCM_16", "FLOAT", "ULAW"],
    "W64": ["PCM_16", "FLOAT"],
    "CAF": ["PCM_16", "FLOAT", "ALAC_16"],
    "MP3": ["MPEG_LAYER_III"],
}
LOSSLESS = ("WAV", "FLAC", "AIFF", "AU", "W64", "CAF")
RATES = [1000, 4000, 8000, 11025, 16000, 22050, 24000, 32000, 44100, 48000, 88200, 96000, 192000, 384000]
CONTENT_TYPES = ["audio/wav", "audio/x-wav", "audio/flac", "audio/ogg", "audio/mpeg", "audio/aiff", "audio/whatever",
                 "application/octet-stream", "AUDIO/WAV", "audio/wav; charset=utf-8", "text/plain", "application/json",
                 "", "multipart/form-data", "image/png", "audio/", "audio/wav;;;", "x" * 300]
MAGICS = [b"RIFF", b"RIFX", b"RF64", b"fLaC", b"OggS", b"ID3", b"\xff\xfb", b"FORM", b".snd", b"caff", b"riff",
          b"RIFF\xff\xff\xff\xffWAVEfmt ", b""]
WEIRD_NUMBERS = ["nan", "inf", "-inf", "-1", "0", "1e308", "-0", "12", "abc", "", "1e-320", "0x10", " 6 ", "6dB"]


@dataclass
class AudioSpec:
    container: str
    subtype: str
    rate: int
    channels: int
    frames: int
    seed: int
    special: str  # none | nan | inf | clip | silence | dc


@dataclass
class Mutation:
    kind: str  # truncate | flip | insert | header_int | none
    where: float  # 0..1 of the file (or of the header for header_int)
    value: int


@dataclass
class UploadCase:
    audio: AudioSpec | None  # None: junk bytes
    junk: bytes
    mutations: list[Mutation]
    content_type: str
    multipart: bool
    field_name: str
    filename: str
    query: dict = field(default_factory=dict)
    form: dict = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        """Valid audio, unmodified, sent the documented way: must be enhanced (200)."""
        a = self.audio
        return (a is not None and not self.mutations and a.frames > 0 and a.special in ("none", "clip", "silence", "dc")
                and a.container in LOSSLESS and a.channels <= 8 and a.rate in RATES
                and ((self.multipart and self.field_name == "file" and self.filename != "") or (not self.multipart
                     and self.content_type.lower().startswith(("audio/", "application/octet-stream"))))
                and not self.query and not self.form)


def make_audio(spec: AudioSpec) -> np.ndarray:
    r = np.random.default_rng(spec.seed)
    x = (0.3 * r.standard_normal((spec.frames, spec.channels))).astype(np.float32)
    if spec.special == "silence":
        x[:] = 0
    elif spec.special == "clip":
        x *= 20
    elif spec.special == "dc":
        x = x * 0.01 + 0.9
    elif spec.special in ("nan", "inf") and spec.frames:
        x[r.integers(spec.frames), r.integers(spec.channels)] = np.nan if spec.special == "nan" else np.inf
    return x


def encode_audio(spec: AudioSpec) -> bytes:
    from enhancer.audio_io import OPUS_RATES, VORBIS_MAX_RATE

    b = io.BytesIO()
    x = make_audio(spec)
    if (spec.subtype == "VORBIS" and spec.rate > VORBIS_MAX_RATE) or (spec.subtype == "OPUS" and spec.rate not in OPUS_RATES):
        spec = AudioSpec("WAV", "FLOAT", spec.rate, spec.channels, spec.frames, spec.seed, spec.special)  # libsndfile
        # would crash (Vorbis) or refuse (Opus) to write this: the fuzzer sends it as a float WAV
    if not spec.subtype.startswith(("FLOAT", "DOUBLE")):
        x = np.clip(np.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0), -1, 1)
    try:
        sf.write(b, x, spec.rate, format=spec.container, subtype=spec.subtype)
    except Exception:  # a combination libsndfile refuses to write: send it as WAV float
        b = io.BytesIO()
        sf.write(b, x, spec.rate, format="WAV", subtype="FLOAT")
    return b.getvalue()


def mutate(data: bytes, mutations: list[Mutation]) -> bytes:
    d = bytearray(data)
    for m in mutations:
        if not d:
            d = bytearray(b"\0")
        i = min(int(m.where * len(d)), len(d) - 1)
        if m.kind == "truncate":
            d = d[:i]
        elif m.kind == "flip":
            d[i] ^= 1 << (m.value % 8)
        elif m.kind == "insert":
            d[i:i] = bytes([m.value % 256]) * (1 + m.value % 17)
        elif m.kind == "header_int":  # overwrite a 32-bit field in the first 64 bytes (sizes, rates, channels)
            j = min(int(m.where * 60), max(len(d) - 4, 0))
            d[j:j + 4] = struct.pack("<I", m.value & 0xFFFFFFFF)[: len(d) - j]
    return bytes(d)


def encode_upload(case: UploadCase) -> bytes:
    data = encode_audio(case.audio) if case.audio is not None else case.junk
    return mutate(data, case.mutations)


# ---------------------------------------------------------------------------------- strategies
audio_specs = st.builds(
    AudioSpec,
    container=st.sampled_from(list(CONTAINERS)),
    subtype=st.just(""),
    rate=st.one_of(st.sampled_from(RATES), st.integers(1, 400_000)),
    channels=st.one_of(st.integers(1, 2), st.integers(1, 10)),
    frames=st.one_of(st.integers(0, 400), st.integers(0, 24_000)),
    seed=st.integers(0, 2**31),
    special=st.sampled_from(["none", "none", "none", "nan", "inf", "clip", "silence", "dc"]),
).flatmap(lambda a: st.sampled_from(CONTAINERS[a.container]).map(
    lambda sub: AudioSpec(a.container, sub, a.rate, a.channels, a.frames, a.seed, a.special)))

mutations = st.lists(st.builds(Mutation, kind=st.sampled_from(["truncate", "flip", "insert", "header_int"]),
                               where=st.floats(0, 1), value=st.one_of(st.integers(0, 2**32), st.sampled_from(
                                   [0, 1, 2, 0xFFFFFFFF, 0x7FFFFFFF, 64, 3, 1_000_000_000]))), max_size=3)

junk = st.one_of(st.binary(max_size=2048),
                 st.tuples(st.sampled_from(MAGICS), st.binary(max_size=4096)).map(lambda t: t[0] + t[1]))

query_values = st.dictionaries(st.sampled_from(["atten_lim_db", "format", "x", "api_key"]), st.one_of(
    st.sampled_from(WEIRD_NUMBERS + ["wav", "flac", "ogg", "mp3", "aac", "WAV", "../x"]),
    st.floats(allow_nan=False, allow_infinity=False, min_value=0, max_value=200).map(str),
    st.text(max_size=20)), max_size=2)

uploads = st.builds(
    UploadCase,
    audio=st.one_of(audio_specs, audio_specs, audio_specs, st.none()),
    junk=junk,
    mutations=st.one_of(st.just([]), st.just([]), mutations),
    content_type=st.one_of(st.sampled_from(["audio/wav", "application/octet-stream"]), st.sampled_from(CONTENT_TYPES)),
    multipart=st.booleans(),
    field_name=st.sampled_from(["file"] * 6 + ["upload", "", "FILE"]),
    filename=st.one_of(st.sampled_from(["a.wav", "../../etc/passwd", "/tmp/x.wav", "", "a" * 300, "x.flac"]),
                       st.text(max_size=30)),
    query=st.one_of(st.just({}), st.just({}), query_values),
    form=st.one_of(st.just({}), query_values),
)


# ---------------------------------------------------------------------------------- websocket sessions
@dataclass
class Action:
    kind: str  # binary | text | raw | ping | pause
    data: bytes = b""
    text: str = ""


@dataclass
class SessionCase:
    start: str | None  # text of the first message, or None (binary first: defaults)
    start_params: dict | None  # the parameters it sets when it is a valid start message
    actions: list[Action]
    ending: str  # end | close | abort | none

    def is_clean(self, max_message_bytes: int) -> bool:
        """A valid session: must end with 1000 and exactly as many samples out as in."""
        p = self.start_params
        if p is None or self.ending != "end":
            return False
        width = (2 if p.get("encoding", "pcm_s16le") == "pcm_s16le" else 4) * p.get("channels", 1)
        return all(a.kind in ("binary", "ping", "pause") for a in self.actions) and all(
            len(a.data) % width == 0 and len(a.data) <= max_message_bytes and _finite(a.data, p)
            for a in self.actions if a.kind == "binary")


def _finite(data: bytes, p: dict) -> bool:
    if p.get("encoding", "pcm_s16le") != "f32le":
        return True
    return bool(np.isfinite(np.frombuffer(data, "<f4")).all())


GOOD_RATES = [8000, 16000, 44100, 48000, 22050, 96000]

start_fields = st.fixed_dictionaries({}, optional={
    "sample_rate": st.one_of(st.sampled_from(GOOD_RATES), st.integers(-10, 10**7), st.floats(allow_nan=True),
                             st.text(max_size=5), st.none(), st.booleans()),
    "encoding": st.one_of(st.sampled_from(["pcm_s16le", "f32le"]), st.sampled_from(["mp3", "F32LE", "", "pcm_s24le"]),
                          st.integers(), st.none()),
    "channels": st.one_of(st.integers(1, 3), st.integers(-2, 100), st.floats(), st.sampled_from(["2", None, True])),
    "atten_lim_db": st.one_of(st.none(), st.floats(0, 100), st.floats(), st.sampled_from(["12", True, -3, [1]])),
    "metadata": st.one_of(st.booleans(), st.sampled_from([0, 1, "yes", None])),
    "type": st.sampled_from(["start", "end", "audio", 5]),
    "extra": st.integers(),
})


valid_start = st.fixed_dictionaries({}, optional={
    "sample_rate": st.one_of(st.sampled_from(GOOD_RATES), st.integers(1000, 384_000)),
    "encoding": st.sampled_from(["pcm_s16le", "f32le"]),
    "channels": st.integers(1, 2),
    "atten_lim_db": st.one_of(st.none(), st.floats(0, 100)),
    "metadata": st.booleans(),
    "type": st.just("start"),
})


def _start_valid(d: dict) -> bool:
    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    if set(d) - {"sample_rate", "encoding", "channels", "atten_lim_db", "metadata", "type"}:
        return False
    if d.get("type", "start") != "start":
        return False
    rate = d.get("sample_rate", 16000)
    ch = d.get("channels", 1)
    att = d.get("atten_lim_db")
    return (is_int(rate) and 1000 <= rate <= 384000 and d.get("encoding", "pcm_s16le") in ("pcm_s16le", "f32le")
            and is_int(ch) and 1 <= ch <= 2 and isinstance(d.get("metadata", False), bool)
            and (att is None or (isinstance(att, (int, float)) and not isinstance(att, bool) and att == att and att >= 0)))


@st.composite
def starts(draw):
    """(text of the start message or None, parameters when it is valid)."""
    kind = draw(st.sampled_from(["valid", "valid", "valid", "fields", "fields", "none", "json", "text"]))
    if kind == "valid":
        d = draw(valid_start)
        return json.dumps(d), d
    if kind == "none":
        return None, {}
    if kind == "json":
        value = draw(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                                  lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                                  max_leaves=8))
        return json.dumps(value), None
    if kind == "text":
        return draw(st.sampled_from(["{", "[]", "null", "", "{'a': 1}", "[" * 5000, '{"sample_rate": 1e999}']
                                    ) | st.text(max_size=40)), None
    d = draw(start_fields)
    text = json.dumps(d, allow_nan=True)
    return text, (d if _start_valid(d) else None)


@st.composite
def binary_payload(draw, width: int):
    n = draw(st.one_of(st.integers(0, 40), st.integers(0, 4000), st.integers(0, 40_000)))
    aligned = draw(st.booleans() | st.just(True))
    size = n * width if aligned else n * width + draw(st.integers(1, max(width - 1, 1)))
    fill = draw(st.sampled_from(["noise", "noise", "zeros", "nan", "max"]))
    r = np.random.default_rng(draw(st.integers(0, 2**31)))
    if fill == "zeros":
        return bytes(size)
    if fill == "max":
        return b"\xff\x7f" * (size // 2) + b"\x00" * (size % 2)
    data = bytearray(r.integers(0, 256, size, dtype=np.uint8).tobytes())
    if fill == "noise" and width % 4 == 0:  # well-behaved floats
        k = size // 4
        data[: k * 4] = (0.1 * r.standard_normal(k)).astype("<f4").tobytes()
    elif fill == "nan" and size >= 4:
        data[:4] = struct.pack("<f", float("nan"))
    return bytes(data)


RAW_FRAMES = [
    b"\x81\x05hello",  # unmasked text (clients must mask)
    b"\x9f\x80\x00\x00\x00\x00",  # reserved opcode with FIN
    b"\xc1\x80\x00\x00\x00\x00",  # RSV1 set without an extension
    b"\x81\x82\x00\x00\x00\x00\xc3\x28",  # invalid UTF-8 text
    b"\x09\x80\x00\x00\x00\x00",  # fragmented ping (control frames cannot be fragmented)
    b"\x89\xfe\x00\x80" + b"\x00" * 4 + b"\x00" * 128,  # ping over 125 bytes
    b"\x80\x80\x00\x00\x00\x00",  # continuation with nothing to continue
    b"\x88\x81\x00\x00\x00\x00\x00",  # close frame with a 1-byte payload
]


@st.composite
def sessions(draw):
    start, params = draw(starts())
    enc = (params or {}).get("encoding", "pcm_s16le")
    ch = (params or {}).get("channels", 1)
    width = (2 if enc == "pcm_s16le" else 4) * (ch if isinstance(ch, int) and 1 <= ch <= 8 else 1)
    action = st.one_of(
        binary_payload(width).map(lambda d: Action("binary", d)),
        binary_payload(width).map(lambda d: Action("binary", d)),
        st.sampled_from(['{"type": "end"}', '{"type": "start"}', '{"sample_rate": 16000}', "audio", "", "{}",
                         '{"type": "metadata"}', "[]"]).map(lambda t: Action("text", text=t)),
        st.sampled_from(RAW_FRAMES).map(lambda b: Action("raw", b)),
        st.just(Action("ping")),
        st.just(Action("pause")),
    )
    actions = draw(st.lists(action, max_size=6))
    ending = draw(st.sampled_from(["end", "end", "end", "close", "abort"]))
    if start is None and params is not None and actions and actions[0].kind != "binary":
        params = None  # without a start message the first message must be audio to mean "defaults"
    return SessionCase(start, params if start is not None or (actions and actions[0].kind == "binary") else None,
                       actions, ending)
