"""The single source of truth for the signal path and the model.

`STFTConfig` fixes the signal path of the paper (16 kHz, 512-point STFT, 32 ms window, 16 ms hop).
`ModelConfig` describes the network; `ModelConfig.preset(name)` gives the shipped variants.

Parameter budget
----------------
Appendix A.2 of the paper says both the baseline (hidden 256) and TIM (hidden 512) have about 6 M
parameters, with FFN 1024. Taken literally that is not possible: the pre-encoder alone
(257 -> 1024 -> 512 -> 128 -> 256 channels, kernel 3) holds 2.65 M parameters, and eight blocks of
hidden 256 / FFN 1024 add 6.3 M (about 9 M in all); at hidden 512 the three ordinary blocks alone hold
6.3 M and TIM comes to about 15 M. Section 4.2 gives the rule that can hold: TIM "increased the total
number of hidden units and heads (by about 20%) to match the number of parameters of the baseline".

So the presets keep the pre-encoder, 8 blocks and 16 heads of the paper, keep the baseline at hidden
256, give TIM about 20 % more hidden units (304 = 16 heads x 19; two mechanisms of 152), and use
FFN 512 in both, which lands both near the paper's budget and within 1 % of each other:

    baseline   hidden 256, FFN 512                 6,945,921 parameters (2,663,040 in the pre-encoder)
    tim        hidden 304, FFN 512 (n_s = 2)       6,987,947 parameters (+0.6 %)

`python -m enhancer info --preset NAME` prints the exact count; a test holds the 5 % bound.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

SAMPLE_RATE = 16000


@dataclass(frozen=True)
class STFTConfig:
    """Analysis/synthesis settings. sqrt-Hann (periodic) analysis and synthesis windows: their
    product is a Hann window, which sums to one at 50 % overlap, so the pair reconstructs exactly."""

    sample_rate: int = SAMPLE_RATE
    n_fft: int = 512  # 32 ms at 16 kHz
    hop: int = 256  # 16 ms
    window: str = "sqrt_hann"

    @property
    def n_freqs(self) -> int:
        return self.n_fft // 2 + 1

    def validate(self) -> None:
        if self.n_fft != 2 * self.hop:
            raise ValueError(f"n_fft must be twice the hop for 50 % overlap, got {self.n_fft}/{self.hop}")
        if self.window != "sqrt_hann":
            raise ValueError(f"unsupported window {self.window!r}; only 'sqrt_hann' is implemented")


@dataclass(frozen=True)
class ModelConfig:
    """Network hyper-parameters. Checkpoints store these fields (never a pickled class)."""

    name: str = "tim"
    # pre-encoder: four Conv1d over time, each followed by LayerNorm and LeakyReLU
    conv_channels: tuple[int, ...] = (1024, 512, 128, 256)
    kernel_size: int = 3
    lookahead: int = 2  # frames of future context of the whole stack (2 = 32 ms)
    # encoder
    n_layers: int = 8
    d_model: int = 304
    d_ffn: int = 512
    n_heads: int = 16
    n_mechanisms: int = 2  # mechanisms of the TIM blocks; 1 = plain Transformer everywhere
    first_plain: int = 2  # ordinary Transformer blocks before the TIM blocks
    last_plain: int = 1  # ordinary Transformer blocks after them
    competition: bool = True  # TIM-Comp (True) or TIM-NoComp (False)
    inter_heads: int = 2  # inter-mechanism attention: 2 heads x 32 units (paper)
    inter_head_dim: int = 32
    dropout: float = 0.1
    leaky_slope: float = 0.01
    attention_window: int = 128  # frames each frame attends to: itself and W-1 past frames
    # signal / output
    log_eps: float = 1e-4  # log(|X| + eps) on the magnitude of a full-scale-1.0 signal's STFT
    # the gains applied to the noisy spectrum are the network's gains raised to this power (1: as they
    # are; > 1: a gain of 0.5 becomes 0.42 at 1.25, a gain near 1 stays near 1), which removes more of
    # the noise left under speech; the training objective is on the network's gains (`TIMNet.forward`)
    gain_exponent: float = 1.0
    # the rise limit (`enhancer.build.model.postfilter`): in noisy streams, a network gain below
    # `rise_limit_gain` may not rise above the previous frame's gain in its bin (0: off)
    rise_limit_gain: float = 0.0
    rise_limit_snr_db: tuple[float, float] = (-6.0, 3.0)  # applied in full at or below the first, not at all from the second
    rise_limit_seconds: float = 0.5  # time constant of its running estimate of the stream's SNR
    # the pitch filter (`enhancer.build.model.pitchfilter`): in voiced frames, the noisy spectrum is mixed
    # with the input one pitch period earlier before the gains apply; the mixing strength (0: off)
    pitch_filter: float = 0.0
    pitch_filter_voicing: float = 0.6  # frames whose pitch correlation is above this are voiced
    stft: STFTConfig = field(default_factory=STFTConfig)

    # ----------------------------------------------------------------- presets
    @staticmethod
    def presets() -> tuple[str, ...]:
        return tuple(_PRESETS)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """`tim` (TIM-Comp, n_s=2, default), `tim-nocomp`, `tim4` (n_s=4), `baseline`,
        `tim-lowlatency` (0 lookahead frames, 32 ms algorithmic latency)."""
        if name not in _PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(_PRESETS)}")
        cfg = dataclasses.replace(cls(), name=name, **_PRESETS[name])
        cfg = dataclasses.replace(cfg, **_renamed(overrides)) if overrides else cfg
        cfg.validate()
        return cfg

    # ----------------------------------------------------------------- derived values
    @property
    def n_freqs(self) -> int:
        return self.stft.n_freqs

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def is_tim_layer(self, i: int) -> bool:
        return self.n_mechanisms > 1 and self.first_plain <= i < self.n_layers - self.last_plain

    @property
    def n_tim_layers(self) -> int:
        return sum(self.is_tim_layer(i) for i in range(self.n_layers))

    @property
    def delay_samples(self) -> int:
        """Delay of the output stream relative to the input stream, in samples."""
        return (self.lookahead + 1) * self.stft.hop

    @property
    def algorithmic_latency_ms(self) -> float:
        """Window plus lookahead: the longest a sample waits before its enhanced version leaves."""
        return 1000.0 * (self.stft.n_fft + self.lookahead * self.stft.hop) / self.stft.sample_rate

    def validate(self) -> None:
        self.stft.validate()
        problems = []
        if len(self.conv_channels) != 4:
            problems.append(f"conv_channels needs 4 layers, got {len(self.conv_channels)}")
        if self.kernel_size < 1:
            problems.append("kernel_size must be >= 1")
        if not 0 <= self.lookahead <= len(self.conv_channels) * (self.kernel_size - 1):
            problems.append(f"lookahead {self.lookahead} must be in [0, {len(self.conv_channels) * (self.kernel_size - 1)}]")
        if self.d_model % self.n_heads:
            problems.append(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.n_mechanisms < 1:
            problems.append("n_mechanisms must be >= 1")
        elif self.n_heads % self.n_mechanisms or self.d_model % self.n_mechanisms or self.d_ffn % self.n_mechanisms:
            problems.append(
                f"n_heads ({self.n_heads}), d_model ({self.d_model}) and d_ffn ({self.d_ffn}) "
                f"must all be divisible by n_mechanisms ({self.n_mechanisms})"
            )
        if self.first_plain + self.last_plain > self.n_layers:
            problems.append("first_plain + last_plain exceeds n_layers")
        if self.attention_window < 1:
            problems.append("attention_window must be >= 1 frame")
        if not 0.5 <= self.gain_exponent <= 4.0:
            problems.append(f"gain_exponent must be in [0.5, 4], got {self.gain_exponent}")
        if not 0.0 <= self.rise_limit_gain <= 1.0:
            problems.append(f"rise_limit_gain must be in [0, 1], got {self.rise_limit_gain}")
        if len(self.rise_limit_snr_db) != 2 or not self.rise_limit_snr_db[0] < self.rise_limit_snr_db[1]:
            problems.append(f"rise_limit_snr_db must be two increasing values in dB, got {self.rise_limit_snr_db}")
        if not self.rise_limit_seconds > 0:
            problems.append(f"rise_limit_seconds must be > 0, got {self.rise_limit_seconds}")
        if not 0.0 <= self.pitch_filter <= 2.0:
            problems.append(f"pitch_filter must be in [0, 2], got {self.pitch_filter}")
        if not 0.0 <= self.pitch_filter_voicing < 1.0:
            problems.append(f"pitch_filter_voicing must be in [0, 1), got {self.pitch_filter_voicing}")
        if self.pitch_filter and (self.stft.sample_rate, self.stft.n_fft, self.stft.hop) != (16000, 512, 256):
            problems.append("the pitch filter needs 16 kHz frames of 512 samples every 256")
        if problems:
            raise ValueError("invalid ModelConfig: " + "; ".join(problems))

    # ----------------------------------------------------------------- (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["conv_channels"] = list(self.conv_channels)
        d["rise_limit_snr_db"] = list(self.rise_limit_snr_db)
        if not self.rise_limit_gain:  # off: stored as before the rise limit existed
            for k in ("rise_limit_gain", "rise_limit_snr_db", "rise_limit_seconds"):
                del d[k]
        if not self.pitch_filter:  # off: stored as before the pitch filter existed
            for k in ("pitch_filter", "pitch_filter_voicing"):
                del d[k]
        # stored under its old name: checkpoints and exported models keep the format older runtimes read
        return {STORED_AS.get(k, k): v for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """The config of `to_dict`, also as stored before a field was renamed (`RENAMED`: the
        checkpoints, exported models and run folders written then)."""
        d = _renamed(d)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig fields: {', '.join(unknown)}")
        if "stft" in d:
            sknown = {f.name for f in fields(STFTConfig)}
            bad = sorted(set(d["stft"]) - sknown)
            if bad:
                raise ValueError(f"unknown STFTConfig fields: {', '.join(bad)}")
            d["stft"] = STFTConfig(**d["stft"])
        for k in ("conv_channels", "rise_limit_snr_db"):
            if k in d:
                d[k] = tuple(d[k])
        cfg = cls(**d)
        cfg.validate()
        return cfg


# Fields stored under another name before: old name -> field. `window` was the attention window in
# frames (not `STFTConfig.window`, the analysis window's name).
RENAMED = {"window": "attention_window"}
STORED_AS = {new: old for old, new in RENAMED.items()}  # `to_dict` writes the stored names


def _renamed(d: dict[str, Any]) -> dict[str, Any]:
    """`d` with old field names (`RENAMED`) replaced by the current ones."""
    out = {RENAMED.get(k, k): v for k, v in d.items()}
    both = [k for k, new in RENAMED.items() if k in d and new in d]
    if both:
        raise ValueError(f"ModelConfig: give either {both[0]!r} or {RENAMED[both[0]]!r}, not both")
    return out


_PRESETS: dict[str, dict[str, Any]] = {
    "tim": dict(d_model=304, d_ffn=512, n_mechanisms=2, competition=True),
    "tim-nocomp": dict(d_model=304, d_ffn=512, n_mechanisms=2, competition=False),
    "tim4": dict(d_model=304, d_ffn=512, n_mechanisms=4, competition=True),
    "baseline": dict(d_model=256, d_ffn=512, n_mechanisms=1, competition=False),
    "tim-lowlatency": dict(d_model=304, d_ffn=512, n_mechanisms=2, competition=True, lookahead=0),
}
