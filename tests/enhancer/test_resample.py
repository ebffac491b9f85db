"""The stream resampler (`enhancer.resample`): a tone in the pass band comes out at the new rate in
time with the input, ATTEN_DB under it what it is not; one above the lower rate's Nyquist frequency
is gone; every chunking gives the same samples bit for bit; a sample waits the stated delay; the
output totals the input's length times the ratio; a state that does not fit is refused."""
import numpy as np
import pytest

from enhancer import signal
from enhancer.resample import ATTEN_DB, PASS, StreamResampler, delay_ms, output_length

PAIRS = [(48000, 16000), (16000, 48000), (44100, 16000), (16000, 44100), (22050, 16000), (16000, 8000),
         (8000, 16000), (96000, 16000), (3999, 16000), (16000, 3999)]  # the last two: no short period


def _run(fr, to, x, chunks, channels):
    r, out, i = StreamResampler(fr, to, channels), [], 0
    for n in chunks:
        out.append(r.process(x[i:i + n]))
        i += n
    out.append(r.process(x[i:], last=True))
    return np.concatenate(out)


def _tone(f, rate, n, phase=0.3):
    return np.sin(2 * np.pi * f * np.arange(n) / rate + phase)


@pytest.mark.parametrize("fr,to", PAIRS)
def test_a_pass_band_tone_comes_out_aligned_and_clean(fr, to):
    n = fr  # one second
    for f in (300.0, 0.9 * PASS * min(fr, to) / 2):
        y = signal.resample(_tone(f, fr, n).astype(np.float32), fr, to)
        assert y.shape == (output_length(n, fr, to),)
        ref = _tone(f, to, len(y))
        mid = slice(len(y) // 5, 4 * len(y) // 5)  # away from the ends, where the input stops
        err_db = 10 * np.log10(np.mean(ref[mid] ** 2) / np.mean((y[mid] - ref[mid]) ** 2))
        assert err_db > ATTEN_DB - 10, (f, err_db)  # a delay of one sample would leave about 20 dB


@pytest.mark.parametrize("fr,to", [(48000, 16000), (44100, 16000), (16000, 48000)])
def test_what_the_lower_rate_cannot_hold_is_removed(fr, to):
    """Down: a tone above the new Nyquist frequency would alias into the band; up: the images of
    a tone below it would appear above it. Both are ATTEN_DB down, near enough."""
    n = fr
    if fr > to:
        x, f_out = _tone(0.5 * to + 1000.0, fr, n), None
    else:
        x, f_out = _tone(0.5 * fr - 1000.0, fr, n), 0.5 * fr + 1000.0  # its first image
    y = signal.resample(x.astype(np.float32), fr, to)
    y = y[len(y) // 5:4 * len(y) // 5]  # away from the ends, where the tone starts and stops
    if f_out is None:
        level = np.mean(y ** 2) / np.mean(x ** 2)
    else:  # the image's power, by projection on it
        t = np.arange(len(y)) / to
        level = 2 * (np.mean(y * np.sin(2 * np.pi * f_out * t)) ** 2 + np.mean(y * np.cos(2 * np.pi * f_out * t)) ** 2)
        level /= np.mean(x ** 2)
    assert 10 * np.log10(level + 1e-30) < -(ATTEN_DB - 10), level


@pytest.mark.parametrize("fr,to", PAIRS)
def test_every_chunking_gives_the_same_samples(fr, to):
    rng = np.random.default_rng(fr + to)
    x = (0.1 * rng.standard_normal((fr // 2, 2))).astype(np.float32)
    ref = _run(fr, to, x, [], 2)
    assert ref.shape == (output_length(len(x), fr, to), 2)
    for chunks in ([fr // 100] * 40, list(rng.integers(1, fr // 20, 60)), [1] * 300 + [fr // 7]):
        assert np.array_equal(_run(fr, to, x, chunks, 2), ref)
    for ch in range(2):  # each channel as a stream of its own
        assert np.array_equal(_run(fr, to, x[:, ch:ch + 1], [fr // 60] * 20, 1)[:, 0], ref[:, ch])


@pytest.mark.parametrize("fr,to", PAIRS)
def test_a_sample_waits_the_filters_delay(fr, to):
    """After n input samples, every output sample up to the input's time less the delay is out,
    and none after it (it would need input not yet given)."""
    r, given = StreamResampler(fr, to, 1), 0
    delay = round(delay_ms(fr, to) * to / 1000)
    assert 1 <= delay_ms(fr, to) <= 6.7 * 16000 / min(fr, to) + 0.1  # the transition band: a share of the lower Nyquist
    for n in (1, fr // 100, fr // 100, 3 * fr // 100 + 7):
        given += len(r.process(np.zeros((n, 1), np.float32)))
        ready = (r.n_in * to - 1) // fr + 1  # output samples whose time the input has reached
        assert given == max(ready - delay, 0), (r.n_in, given, ready, delay)
    assert delay_ms(16000, 16000) == 0.0


@pytest.mark.parametrize("n", [0, 1, 2, 3, 47, 1000, 48001, 48002])
def test_the_total_is_the_input_length_times_the_ratio(n):
    for fr, to in ((48000, 16000), (44100, 16000), (16000, 44100), (16000, 22050)):
        x = np.ones((n, 1), np.float32)
        assert len(_run(fr, to, x, [n // 2], 1)) == round(n * to / fr + 1e-9) == output_length(n, fr, to)


def test_coprime_rates_are_filtered_directly_in_little_memory():
    """65537 Hz has no short period with 16 kHz (a matrix per period would take gigabytes): each
    output sample takes its own taps from a table; the pass band is as clean."""
    import resource

    from enhancer.resample import _direct

    assert _direct(65537, 16000) and _direct(16000, 65537) and not _direct(44100, 16000)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    y = signal.resample(_tone(1000.0, 65537, 65537 // 4).astype(np.float32), 65537, 16000)
    ref = _tone(1000.0, 16000, len(y))
    mid = slice(len(y) // 5, 4 * len(y) // 5)
    assert 10 * np.log10(np.mean(ref[mid] ** 2) / np.mean((y[mid] - ref[mid]) ** 2)) > ATTEN_DB - 10
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB


def test_a_state_that_does_not_fit_is_refused():
    r = StreamResampler(48000, 16000, 2)
    r.process(np.zeros((1000, 2), np.float32))
    state = r.state()
    with pytest.raises(ValueError, match="not a state of this one"):
        StreamResampler(48000, 16000, 1).load_state(state)  # another channel count
    with pytest.raises(ValueError, match="not a state of this one"):
        StreamResampler(48000, 16000, 2).load_state({**state, "n_in": state["n_in"] + 480})
    with pytest.raises(ValueError, match="not a state of this one"):
        StreamResampler(44100, 16000, 2).load_state(state)  # another rate
    again = StreamResampler(48000, 16000, 2)
    again.load_state(state)
    x = np.random.default_rng(0).standard_normal((500, 2)).astype(np.float32)
    assert np.array_equal(again.process(x), r.process(x))
