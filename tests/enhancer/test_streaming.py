"""Streaming: offline torch == streaming torch == streaming ONNX, lengths, reset, rates, channels, errors."""
import numpy as np
import pytest
import torch

from enhancer.build.model import StreamingStep
from enhancer.errors import AudioError, CheckpointError
from enhancer.runtime import Enhancer, LanePool, min_gain_for
from enhancer.step_io import StepOutputs, init_rings, init_states, output_names, write_rings
from tests.conftest import SHORT_WINDOW, speechlike
from tests.tolerance import assert_close_to_peak, assert_differs, peak

SECONDS = 1.5  # 94 frames: several times the test models' attention window (16 frames)


def random_chunks(n: int, rng, max_len: int = 16000):
    """Chunk lengths from 1 sample to 1 s, log-uniform, covering n."""
    out, i = [], 0
    while i < n:
        k = int(np.exp(rng.uniform(0, np.log(max_len))))
        out.append(min(k, n - i))
        i += k
    return out


def stream_through(stream, x, chunks):
    parts, i = [], 0
    for k in chunks:
        parts.append(stream.feed(x[i:i + k]))
        i += k
    parts.append(stream.flush())
    return np.concatenate(parts, axis=0)


def torch_streaming(model, x: np.ndarray, chunks=None) -> np.ndarray:
    """The torch step module (the graph that is exported) run hop by hop, or in calls of `chunks`
    frames (cycled)."""
    cfg = model.config
    step = StreamingStep(model).eval()
    states, rings = [torch.from_numpy(c) for c in init_states(cfg, 1)], torch.from_numpy(init_rings(cfg, 1))
    hop = cfg.stft.hop
    steps = -(-(cfg.delay_samples + len(x)) // hop)
    xp = np.zeros(steps * hop, np.float32)
    xp[: len(x)] = x
    hops = xp.reshape(1, steps, hop)
    pos, outs, s, i = torch.zeros(1, dtype=torch.long), [], 0, 0
    with torch.no_grad():
        while s < steps:
            t = min(chunks[i % len(chunks)] if chunks else 1, steps - s)
            o = StepOutputs.decode(cfg, step(torch.from_numpy(hops[:, s:s + t]), torch.zeros(1), pos, *states, *rings))
            outs.append(o.out[0].numpy().reshape(-1))
            write_rings(rings, o.kv_rows, pos, cfg.attention_window)
            states = list(o.states)
            pos, s, i = pos + t, s + t, i + 1
    return np.concatenate(outs)[cfg.delay_samples: cfg.delay_samples + len(x)]


def test_offline_torch_equals_streaming_torch_equals_streaming_onnx(torch_model, enhancer_rt, rng):
    x = speechlike(int(SECONDS * 16000), seed=5)
    assert len(x) > 4 * SHORT_WINDOW * 256
    offline = torch_model.enhance(torch.from_numpy(x)[None])[0].numpy()
    streamed_torch = torch_streaming(torch_model, x)
    streamed_onnx = stream_through(enhancer_rt.stream(), x, random_chunks(len(x), rng))
    assert peak(offline) > 1e-2 * peak(x)  # the model passes a real signal, not silence
    assert streamed_onnx.shape == offline.shape == x.shape
    assert_close_to_peak(streamed_torch, offline)
    assert_close_to_peak(streamed_onnx, offline)
    # offline enhance of the runtime runs the same graph
    assert_close_to_peak(enhancer_rt.enhance(x, 16000), offline)


def test_attenuation_limit_matches_torch(torch_model, enhancer_rt):
    x = speechlike(8000, seed=2)
    ref = torch_model.enhance(torch.from_numpy(x)[None], min_gain=min_gain_for(12.0))[0].numpy()
    got = enhancer_rt.enhance(x, 16000, atten_lim_db=12.0)
    assert_close_to_peak(got, ref)
    assert_differs(got, enhancer_rt.enhance(x, 16000))


@pytest.mark.parametrize("seed", range(4))
def test_total_output_length_equals_input_for_every_chunking(enhancer_rt, seed):
    r = np.random.default_rng(seed)
    n = int(r.integers(1, 30000))
    x = speechlike(n, seed=seed)
    chunks = random_chunks(n, r, max_len=int(r.choice([1, 7, 300, 16000])) + 1)
    ref = enhancer_rt.enhance(x, 16000)
    got = stream_through(enhancer_rt.stream(), x, chunks)
    assert got.shape == (n,)
    assert_close_to_peak(got, ref)


def test_single_sample_chunks(enhancer_rt):
    x = speechlike(1500, seed=8)
    got = stream_through(enhancer_rt.stream(), x, [1] * len(x))
    assert_close_to_peak(got, enhancer_rt.enhance(x, 16000))


def test_feed_returns_audio_as_it_becomes_ready(enhancer_rt):
    s = enhancer_rt.stream()
    hop, delay = 256, enhancer_rt.delay_samples
    assert s.feed(np.zeros(delay, np.float32)).shape == (0,)  # all of it is still delay
    out = s.feed(np.zeros(10 * hop, np.float32))
    assert out.shape == (10 * hop,)


@pytest.mark.parametrize("rate", [16000, 48000, 44100, 8000])
def test_a_stream_holds_back_what_delay_at_says(enhancer_rt, rate):
    """Fed a few samples at a time, a stream's output lags its input by `delay_at` (the model's
    delay and the resamplers') at least, and by at most that, a hop and a chunk more."""
    from enhancer.cursor import delay_at

    s, given, held, chunk = enhancer_rt.stream(rate), 0, [], 7
    x = np.zeros(rate, np.float32)
    for i in range(0, len(x), chunk):
        given += len(s.feed(x[i:i + chunk]))
        held.append(min(i + chunk, len(x)) - given)
    held = np.array(held[len(held) // 4:])
    delay, hop = delay_at(enhancer_rt.config, rate), -(-256 * rate // 16000)
    slack = 2 + -(-rate // 16000)  # each resampler's outputs fall on its own grid: a sample of 16 kHz
    assert abs(held.min() - delay) <= slack and held.max() <= delay + hop + chunk + slack, (held.min(), held.max(), delay)


def test_reset_makes_a_second_stream_identical_to_a_fresh_one(enhancer_rt):
    a = speechlike(9000, seed=1)
    b = speechlike(7000, seed=2)
    fresh = enhancer_rt.stream()
    expect = np.concatenate([fresh.feed(b), fresh.flush()])
    s = enhancer_rt.stream()
    s.feed(a[:5000])  # abandon mid-stream
    s.reset()
    got = np.concatenate([s.feed(b), s.flush()])
    assert np.array_equal(got, expect)
    # flush also leaves the stream fresh
    s.feed(a)
    s.flush()
    again = np.concatenate([s.feed(b), s.flush()])
    assert np.array_equal(again, expect)


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 44100, 48000])
@pytest.mark.parametrize("channels", [1, 2])
def test_rates_and_channels_round_trip(enhancer_rt, rate, channels):
    x = speechlike(int(0.7 * rate), sr=rate, seed=rate, channels=channels if channels > 1 else 0)
    y = enhancer_rt.enhance(x, rate)
    assert y.shape == x.shape and y.dtype == np.float32 and np.isfinite(y).all()
    assert peak(y) > 1e-2 * peak(x)
    if channels == 2:  # channels are processed independently, each like a mono signal
        assert_close_to_peak(y[:, 1], enhancer_rt.enhance(x[:, 1], rate))


def test_streaming_at_48k_stereo_matches_offline(enhancer_rt, rng):
    x = speechlike(48000, sr=48000, seed=4, channels=2)
    got = stream_through(enhancer_rt.stream(48000, 2), x, random_chunks(len(x), rng))
    assert got.shape == x.shape
    assert_close_to_peak(got, enhancer_rt.enhance(x, 48000))


def test_shape_n_by_1_is_kept(enhancer_rt):
    x = speechlike(3000)[:, None]
    assert enhancer_rt.enhance(x, 16000).shape == (3000, 1)


@pytest.mark.parametrize("bad, match", [
    (np.array([0.1, np.nan] * 100, np.float32), "NaN or Inf"),
    (np.array([0.1, -np.inf] * 100, np.float32), "NaN or Inf"),
    (np.zeros(0, np.float32), "empty"),
    (np.zeros((2, 3, 4), np.float32), "shape"),
])
def test_bad_audio_gives_specific_errors(enhancer_rt, bad, match):
    with pytest.raises(AudioError, match=match):
        enhancer_rt.enhance(bad, 16000)


def test_stream_errors_keep_the_stream_usable(enhancer_rt):
    s = enhancer_rt.stream(16000, 1)
    x = speechlike(4000)
    first = s.feed(x[:2000])
    with pytest.raises(AudioError, match="NaN or Inf"):
        s.feed(np.full(100, np.nan, np.float32))
    with pytest.raises(AudioError, match="channel"):
        s.feed(np.zeros((100, 2), np.float32))
    rest = np.concatenate([s.feed(x[2000:]), s.flush()])
    assert_close_to_peak(np.concatenate([first, rest]), enhancer_rt.enhance(x, 16000))


def test_bad_rates_and_limits(enhancer_rt):
    with pytest.raises(AudioError, match="sample rate"):
        enhancer_rt.enhance(np.zeros(100, np.float32), 10**8)
    with pytest.raises(AudioError, match="channels"):
        enhancer_rt.stream(16000, 0)
    with pytest.raises(AudioError, match="atten_lim_db"):
        enhancer_rt.stream(16000, 1, atten_lim_db=-3)


def test_missing_or_foreign_model_file(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        Enhancer.from_pretrained(tmp_path / "none.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"\x08\x01garbage")
    with pytest.raises(CheckpointError, match="cannot load model|not a tim-enhancer"):
        Enhancer.from_pretrained(tmp_path / "junk.onnx")


def test_lane_pool_batches_streams_independently(enhancer_rt):
    """Streams stepped together in one call give what each gives alone, whatever the lane layout."""
    pool = LanePool(enhancer_rt.engine, 6)
    a = enhancer_rt.stream(pool=pool)  # lane 0
    spacer = pool.alloc(1)  # lane 1: idle, inside the range of a joint step
    b = enhancer_rt.stream(16000, 2, pool=pool)  # lanes 2, 3
    xa, xb = speechlike(6000, seed=1), speechlike(6000, seed=2, channels=2)
    ca, cb = a.cursor, b.cursor  # what a scheduler drives
    ca.push(xa)
    cb.push(xb)
    # step b's lanes alone for a few hops, then a and b together (non-contiguous lane sets)
    for _ in range(3):
        r = pool.step(b.lanes, cb.take_hop(), np.zeros(2, np.float32))
        cb.put_output(r.out, r.competition, r.activity)
    while ca.ready_hops() and cb.ready_hops():
        lanes = np.concatenate([a.lanes, b.lanes])
        hops = np.concatenate([ca.take_hop(), cb.take_hop()])
        r = pool.step(lanes, hops, np.zeros(3, np.float32))
        ca.put_output(r.out[:1], None, None)
        cb.put_output(r.out[1:], None, None)
    ya = np.concatenate([ca.pull()[:, 0], a.flush()])
    yb = np.concatenate([cb.pull(), b.flush()])
    assert_close_to_peak(ya, enhancer_rt.enhance(xa, 16000))
    assert_close_to_peak(yb, enhancer_rt.enhance(xb, 16000))
    assert pool.pos[spacer[0]] == 0 and not pool.caches[0][spacer[0]].any()  # idle lane untouched
    a.close()
    b.close()
    pool.free(spacer)
    assert pool.n_free == 6


def test_metadata_per_step(enhancer_rt):
    s = enhancer_rt.stream(metadata=True)
    s.feed(speechlike(256 * 10))
    meta = s.metadata.pop()
    assert len(meta) == 10
    comp = meta[0].competition
    assert comp.shape == (1, 5, 2)
    np.testing.assert_allclose(comp.sum(-1), 1.0, atol=1e-5)
    assert 0.0 < float(meta[0].activity[0]) < 1.0
    assert s.metadata.pop() == []


def test_model_of_another_step_format_is_refused(model_path, tmp_path):
    """A graph exported with another cache layout must not run with this runtime's ring writes."""
    import onnx

    proto = onnx.load(str(model_path))
    for entry in proto.metadata_props:
        if entry.key == "tim_enhancer.step_format":
            entry.value = "1"
    old = tmp_path / "old.onnx"
    onnx.save(proto, str(old))
    with pytest.raises(CheckpointError, match="step graph format '1'.*re-export"):
        Enhancer.from_pretrained(old)
    Enhancer.from_pretrained(model_path)  # the original loads


def test_outputs_are_read_by_name_whatever_their_order_in_the_graph(model_path, enhancer_rt, tmp_path):
    """The runtime decodes the step's outputs by their names: a graph listing them in another
    order gives the same audio and metadata."""
    import onnx

    proto = onnx.load(str(model_path))
    outputs = list(proto.graph.output)
    assert [o.name for o in outputs] == output_names(enhancer_rt.config)
    del proto.graph.output[:]
    proto.graph.output.extend(outputs[::-1])
    shuffled = tmp_path / "reversed-outputs.onnx"
    onnx.save(proto, str(shuffled))
    other = Enhancer.from_pretrained(shuffled, providers=["CPUExecutionProvider"])
    assert other.engine.output_names[0] != "out"
    x = speechlike(9000, seed=11)
    np.testing.assert_array_equal(other.enhance(x, 16000), enhancer_rt.enhance(x, 16000))
    a, b = other.stream(metadata=True), enhancer_rt.stream(metadata=True)
    a.feed(x[:4000]), b.feed(x[:4000])
    for ma, mb in zip(a.metadata.pop(), b.metadata.pop(), strict=True):
        np.testing.assert_array_equal(ma.competition, mb.competition)
        np.testing.assert_array_equal(ma.activity, mb.activity)


def test_step_outputs_decode_by_name():
    from enhancer import ModelConfig

    cfg = ModelConfig.preset("tim", attention_window=4)
    names = output_names(cfg)
    o = StepOutputs.decode(cfg, list(range(len(names))))
    assert (o.out, o.competition, o.activity, o.kv_rows) == (0, 1, 2, 3) and o.states == list(range(4, len(names)))
    back = StepOutputs.decode(cfg, list(range(len(names)))[::-1], names[::-1])
    assert back == o
    plain = ModelConfig.preset("baseline", attention_window=4)
    assert StepOutputs.decode(plain, list(range(len(output_names(plain))))).competition is None
    with pytest.raises(ValueError, match="step outputs"):
        StepOutputs.decode(cfg, [0, 1])
