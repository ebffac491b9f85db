"""A stream handed to another process (`enhancer.handoff`, `StreamCursor.state_bytes` /
`load_state_bytes`): the resampler rebuilt from its state continues bit for bit; a stream cut
anywhere, once or twice, and continued by a new cursor from its state gives the uninterrupted
run's output at any rate, channel count, band, level and with the upper band's head; a state of
another model or stream, a damaged one, or one whose arrays do not fit is a StateError that leaves
the new stream fresh."""
import io

import numpy as np
import pytest

from enhancer import handoff
from enhancer.errors import StateError
from enhancer.resample import StreamResampler
from tests.conftest import speechlike
from tests.enhancer.test_upperhead import random_weights
from tests.tolerance import assert_close_to_peak


def _cut(x, cuts, step, feed, hand_over):
    """x fed `step` samples at a time (`feed(chunk)` -> output), handed over (`hand_over(at)`) at each
    of `cuts`: the outputs."""
    out, i = [], 0
    for cut in [*cuts, len(x)]:
        while i < cut:
            j = min(i + step, cut)
            out.append(feed(x[i:j]))
            i = j
        if cut < len(x):
            hand_over(cut)
    return out


@pytest.mark.parametrize("rates", [(48000, 16000), (16000, 48000), (44100, 16000), (16000, 22050), (8000, 16000),
                                   (192000, 16000), (16000, 16000)])
def test_a_rebuilt_resampler_continues_bit_for_bit(rates):
    fr, to = rates
    x = (0.1 * np.random.default_rng(1).standard_normal((fr * 2, 2))).astype(np.float32)
    step = fr // 60

    def run(cuts):
        r = [StreamResampler(fr, to, 2)]

        def hand_over(_):
            state = r[0].state()
            r[0] = StreamResampler(fr, to, 2)
            r[0].load_state(state)

        out = _cut(x, cuts, step, lambda chunk: r[0].process(chunk), hand_over)
        return np.concatenate(out + [r[0].process(x[:0], last=True)])

    ref = run([])
    for cuts in ([step // 3], [fr // 2 + 5, fr + 17], [3 * step, 3 * step + 1]):
        got = run(cuts)
        assert got.shape == ref.shape and np.array_equal(got, ref), cuts


def _signal(rate, channels, seconds, seed):
    x = speechlike(int(seconds * rate), rate, seed=seed, channels=channels if channels > 1 else 0)
    noise = 0.03 * np.random.default_rng(seed).standard_normal(x.shape)
    return (x + noise).astype(np.float32)


def _stream(enh, x, rate, channels, cuts, step, **options):
    """x through streams of one-hop calls fed `step` samples at a time, handed to a new stream at
    each of `cuts`; (output, the last state's size)."""
    def fresh():
        s = enh.stream(rate, channels, **options)
        s.frames_per_call = 1  # as a live service steps them
        return s

    s, size = [fresh()], [0]

    def hand_over(at):
        blob = s[0].cursor.state_bytes()
        s[0].close()
        size[0] = len(blob)
        s[0] = fresh()
        assert s[0].cursor.load_state_bytes(blob)["input_samples"] == at

    out = _cut(x, cuts, step, lambda chunk: s[0].feed(chunk), hand_over)
    return np.concatenate(out + [s[0].flush()]), size[0]


@pytest.mark.parametrize("rate, channels, options", [
    (16000, 1, {}), (48000, 2, {"level": "input"}), (44100, 1, {"band": "speech"}), (8000, 1, {"level": "input"}),
    (48000, 1, {"atten_lim_db": 12})])
def test_a_stream_continued_from_its_state_equals_the_uninterrupted_run(enhancer_rt, rate, channels, options):
    x = _signal(rate, channels, 3.0, seed=rate + channels)
    step = rate // 50
    ref, _ = _stream(enhancer_rt, x, rate, channels, [], step, **options)
    got, size = _stream(enhancer_rt, x, rate, channels, [int(0.7 * rate) + 7, int(1.9 * rate)], step, **options)
    assert got.shape == ref.shape == x.shape
    assert_close_to_peak(got, ref)
    assert 0 < size < 4 << 20


def test_a_stream_with_the_upper_band_head_is_continued_too(enhancer_rt):
    from enhancer.upperhead import UpperHead

    engine = enhancer_rt.engine
    kept = engine.upper_head
    try:
        engine.upper_head = UpperHead(random_weights(hidden=8, seed=3))
        x = _signal(48000, 1, 2.0, seed=5)
        ref, _ = _stream(enhancer_rt, x, 48000, 1, [], 960)
        got, _ = _stream(enhancer_rt, x, 48000, 1, [40000], 960)
        assert_close_to_peak(got, ref)
    finally:
        engine.upper_head = kept


def _state_of(enh, rate=48000, channels=1, **options):
    s = enh.stream(rate, channels, **options)
    s.feed(_signal(rate, channels, 0.5, seed=9))
    blob = s.cursor.state_bytes()
    s.close()
    return blob


def _rewrite(blob, change):
    """The archive with `change(arrays)` applied to its flattened arrays (meta included)."""
    with np.load(io.BytesIO(blob), allow_pickle=False) as z:
        arrays = {name: z[name] for name in z.files}
    change(arrays)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _meta(**changes):
    import json

    def change(arrays):
        meta = json.loads(arrays["meta"].tobytes()) | changes
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    return change


@pytest.mark.parametrize("damage, match", [
    (lambda b: b[: len(b) // 2], "not readable"),
    (lambda b: b"PK" + b"\0" * 100, "not readable"),
    (lambda b: _rewrite(b, _meta(model="0" * 32)), "another model"),
    (lambda b: _rewrite(b, _meta(sample_rate=44100)), "sample_rate"),
    (lambda b: _rewrite(b, _meta(level="input")), "level"),
    (lambda b: _rewrite(b, _meta(format=99)), "format"),
    (lambda b: _rewrite(b, lambda a: a.pop("n_in|i")), "missing"),
    (lambda b: _rewrite(b, lambda a: a.update({"extra|i": np.array(1)})), "unknown"),
    (lambda b: _rewrite(b, lambda a: a.update({"n_in|f": a.pop("n_in|i").astype(float)})), "holds a float"),
    (lambda b: _rewrite(b, lambda a: a.update({"pending|a": np.zeros((3, 2), np.float32)})), "pending"),
    (lambda b: _rewrite(b, lambda a: a.update({"pending|a": np.full((3, 1), np.nan, np.float32)})), "out of range"),
    (lambda b: _rewrite(b, lambda a: a.update({"lanes.k0|a": a["lanes.k0|a"][:, :1]})), "k0"),
    (lambda b: _rewrite(b, lambda a: a.update({"lanes.pos|a": np.zeros(2, np.int64)})), "pos"),
])
def test_a_state_that_is_not_of_this_stream_is_refused_and_the_stream_stays_fresh(enhancer_rt, damage, match):
    blob = _state_of(enhancer_rt)
    s = enhancer_rt.stream(48000, 1)
    with pytest.raises(StateError, match=match):
        s.cursor.load_state_bytes(damage(blob))
    x = _signal(48000, 1, 0.5, seed=4)
    fresh = enhancer_rt.stream(48000, 1)
    assert_close_to_peak(np.concatenate([s.feed(x), s.flush()]), np.concatenate([fresh.feed(x), fresh.flush()]))


def test_the_archive_holds_every_leaf_with_its_type():
    tree = {"a": np.arange(3.0), "b": {"c": 3, "d": None, "e": 2.5, "f": True}}
    blob = handoff.pack({"format": handoff.FORMAT, "x": 1}, tree)
    meta, arrays = handoff.unpack(blob)
    assert meta == {"format": handoff.FORMAT, "x": 1} and handoff.peek(blob) == meta
    back = handoff.unflatten(arrays)
    assert back["b"] == {"c": 3, "d": None, "e": 2.5, "f": True} and type(back["b"]["c"]) is int
    np.testing.assert_array_equal(back["a"], tree["a"])
    handoff.check_like(arrays, handoff.flatten(tree))
    with pytest.raises(StateError, match="out of range"):
        handoff.check_like(handoff.flatten({"a": np.arange(3.0), "b": {"c": 1 << 60, "d": None, "e": 1.0, "f": False}}),
                           handoff.flatten(tree))


def test_the_shipped_model_with_8_bit_rings_is_continued_too():
    from enhancer.runtime import Enhancer, default_model_path

    shipped = Enhancer.from_pretrained(default_model_path(), providers=["CPUExecutionProvider"])
    assert shipped.engine.int8_rings
    x = _signal(48000, 2, 2.0, seed=6)
    ref, _ = _stream(shipped, x, 48000, 2, [], 768)
    got, size = _stream(shipped, x, 48000, 2, [50000], 768)
    assert_close_to_peak(got, ref)
    assert size < 2 * 1.5e6  # two lanes of int8 rings and the buffers of 48 kHz
