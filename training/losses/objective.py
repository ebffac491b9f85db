"""The training objective on waveforms: log-magnitude features, the band mask of band-limited
sources, the MSE of the model's log-magnitude estimate, and the feature statistics.

The loss is the MSE between log(|S^| + floor) and log(|S| + floor). By default the floor is the
model's feature epsilon (`log_eps`, 1e-4 of full scale), as in the paper; a larger `loss_floor`
(e.g. 1e-2, about 60 dB below loud speech bins) keeps bins far below anything audible, where clean
speech has next to no energy, from dominating the error. The model's inputs do not change."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from enhancer import ModelConfig
from enhancer.build.model import features, pitchfilter
from enhancer.config import STFTConfig

from ..data.synthesis import Synthesizer
from .perceptual import PesqModel

COMPRESSED_POWER = 0.3  # the power-law compression of the auxiliary magnitude loss
MRSTFT_RESOLUTIONS = ((256, 64), (512, 128), (1024, 256))  # (n_fft, hop) of the multi-resolution STFT loss


def band_weight(bandwidth_hz: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """(B,) bandwidths -> (B, 1, F) 1 for bins at or below the bandwidth, 0 above."""
    freqs = torch.arange(cfg.n_freqs, device=bandwidth_hz.device) * (cfg.stft.sample_rate / cfg.stft.n_fft)  # (F,)
    return (freqs[None, :] <= bandwidth_hz[:, None] + 1e-3).float()[:, None, :]  # (B, 1, F)


@dataclass
class LossSums:
    """The sums a loss is made of, for one batch: the weighted squared errors and the weight.
    Sums (not means) so that a validation set adds them up over its batches and processes."""

    log_err: torch.Tensor  # sum of w * (log-magnitude estimate - clean)^2
    weight: torch.Tensor  # sum of w: the bins compared (band mask)
    compressed_err: torch.Tensor | None = None  # sum of w * (|estimate|^p - |clean|^p)^2, when asked for
    neg_sisdr: torch.Tensor | None = None  # sum over examples of -SI-SDR (dB) of the resynthesised waveform
    mrstft: torch.Tensor | None = None  # sum over examples of the multi-resolution STFT loss
    pesq: torch.Tensor | None = None  # sum over examples of the P.862 disturbance (training.losses.perceptual)
    residual_err: torch.Tensor | None = None  # sum of w * (|estimate|^p - |clean|^p)^2 over noise left in
    # noise-dominated bins (`loss_sums`)
    teacher_err: torch.Tensor | None = None  # sum of w * (log-magnitude estimate - the teacher's)^2
    examples: int = 0

    def loss(self, compressed_weight: float = 0.0, sisdr_weight: float = 0.0, mrstft_weight: float = 0.0,
             pesq_weight: float = 0.0, residual_weight: float = 0.0, teacher_weight: float = 0.0) -> torch.Tensor:
        """The weighted MSE of the log-magnitude, plus `compressed_weight` times that of the
        compressed magnitudes, `sisdr_weight` times the mean -SI-SDR (dB) and `mrstft_weight` times
        the mean multi-resolution STFT loss of the resynthesised waveform, and `pesq_weight` times the
        mean P.862 disturbance of the estimated magnitudes (4.5 minus PESQ's raw score), and
        `residual_weight` times the compressed magnitudes' squared error of the noise left in
        noise-dominated bins, per bin compared, and `teacher_weight` times the log-magnitude MSE
        against a teacher model's estimate."""
        w = self.weight.clamp_min(1.0)
        loss = self.log_err / w
        if compressed_weight > 0.0:
            loss = loss + compressed_weight * (self.compressed_err / w)
        if sisdr_weight > 0.0:
            loss = loss + sisdr_weight * (self.neg_sisdr / max(self.examples, 1))
        if mrstft_weight > 0.0:
            loss = loss + mrstft_weight * (self.mrstft / max(self.examples, 1))
        if pesq_weight > 0.0:
            loss = loss + pesq_weight * (self.pesq / max(self.examples, 1))
        if residual_weight > 0.0:
            loss = loss + residual_weight * (self.residual_err / w)
        if teacher_weight > 0.0:
            loss = loss + teacher_weight * (self.teacher_err / w)
        return loss


def loss_sums(net, core, noisy: torch.Tensor, clean: torch.Tensor, bandwidth: torch.Tensor, autocast,
              loss_floor: float | None = None, compressed_power: float | None = None,
              waveform: tuple[bool, bool] = (False, False), overestimate_weight: float = 1.0,
              pesq: bool = False, pesq_compensate: bool = False, residual: bool = False,
              teacher=None, pitch_filter: bool = False) -> LossSums:
    """noisy, clean (B, N) waveforms, bandwidth (B,) -> the sums of the objective (`LossSums`), the
    compressed term only with a `compressed_power`, the waveform terms (SI-SDR, multi-resolution
    STFT) only where `waveform` asks for them, the P.862 disturbance only with `pesq`. `net` may be a
    DDP wrapper of `core`.

    `overestimate_weight` multiplies the magnitude terms' squared errors in the bins where the estimate
    exceeds the clean magnitude (noise left in), relative to those where it falls short (speech
    removed); 1 = symmetric. The weight `LossSums.weight` stays the count of bins compared.

    With `residual` (and a `compressed_power`), `residual_err` sums the compressed magnitudes' squared
    error over the bins where the noise is louder than the speech (|X - S| > |S|) and the estimate
    exceeds the clean magnitude: the noise left under and between the words, which the log-magnitude
    term weighs no more than a bin of speech removed.

    With a `teacher` (a trained model with the same framing, in eval mode), `teacher_err` sums the
    squared difference of the log-magnitude estimates (the same floor) against the teacher's on the
    same input: a target the student can reach, e.g. one with a shorter attention window.

    With `pitch_filter` (a model whose config has a `pitch_filter` strength), the gains apply to the
    noisy spectrum after the pitch filter, as they do at inference (`enhancer.build.model.pitchfilter`): the
    filter is computed without gradient from the gains raised to the model's `gain_exponent`, and every
    term compares the gains times the filtered spectrum with the clean speech."""
    cfg = core.config
    noisy_spec, clean_spec = features.stft(noisy, cfg.stft), features.stft(clean, cfg.stft)  # (B, T, F)
    noisy_mag, clean_mag = noisy_spec.abs(), clean_spec.abs()
    with autocast():
        gains, _ = net(torch.log(noisy_mag + cfg.log_eps), pad_end=False)  # (B, T - L, F): the model's features
    t = gains.shape[1]
    w = band_weight(bandwidth, cfg).expand(-1, t, -1)  # (B, T - L, F)
    applied = noisy_spec[:, :t]  # the spectrum the gains apply to
    if pitch_filter:
        check_pitch_filter_loss(cfg)
        with torch.no_grad():
            applied = pitchfilter.filter_offline(cfg, noisy.float(), applied, core.sharpen(gains.detach().float()))
    applied_mag = applied.abs()
    est_mag, clean_mag = gains.float() * applied_mag, clean_mag[:, :t]
    floor = cfg.log_eps if loss_floor is None else loss_floor
    w_err = w if overestimate_weight == 1.0 else w * torch.where(est_mag > clean_mag, overestimate_weight, 1.0)
    sums = LossSums(weighted_sq_err(torch.log(est_mag + floor), torch.log(clean_mag + floor), w_err), w.sum(),
                    examples=est_mag.shape[0])
    if compressed_power is not None:
        est_c, clean_c = compressed(est_mag, compressed_power), compressed(clean_mag, compressed_power)
        sums.compressed_err = weighted_sq_err(est_c, clean_c, w_err)
        if residual:
            noise_mag = (noisy_spec[:, :t] - clean_spec[:, :t]).abs()
            w_res = w * ((noise_mag > clean_mag) & (est_mag > clean_mag))
            sums.residual_err = weighted_sq_err(est_c, clean_c, w_res)
    if teacher is not None:
        with torch.no_grad(), autocast():
            t_gains, _ = teacher(torch.log(noisy_mag + cfg.log_eps), pad_end=False)
        t_mag = t_gains.float()[:, :t] * applied_mag
        sums.teacher_err = weighted_sq_err(torch.log(est_mag + floor), torch.log(t_mag + floor), w)
    if pesq:
        sums.pesq = pesq_model(cfg.stft, est_mag.device, pesq_compensate).loss(est_mag * w, clean_mag * w).sum()
    if any(waveform):
        est, ref = resynthesise(gains.float() * applied, clean_spec[:, :t], w, cfg.stft)
        if waveform[0]:
            sums.neg_sisdr = -si_sdr(ref, est).sum()
        if waveform[1]:
            sums.mrstft = mrstft_loss(est, ref).sum()
    return sums


def check_pitch_filter_loss(cfg: ModelConfig) -> None:
    """The pitch filter in the loss (`loss_sums`) needs a model config with one."""
    if cfg.pitch_filter <= 0:
        raise ValueError("the pitch filter in the loss (--pitch-filter-loss) needs a model with a pitch "
                         "filter (config pitch_filter > 0, e.g. --init models/tim.pt)")


def resynthesise(est_spec: torch.Tensor, clean_spec: torch.Tensor, w: torch.Tensor, cfg: STFTConfig):
    """The model's estimate and the clean speech as waveforms, both through the band mask `w`
    (B, T, F), over the samples that every one of the T frames covers twice: -> (B, (T-1) * hop) x 2.
    The overlap-add is differentiable, so the waveform terms reach the gains."""
    n = (est_spec.shape[1] - 1) * cfg.hop
    return features.istft(est_spec * w, n, cfg), features.istft(clean_spec * w, n, cfg)


def si_sdr(ref: torch.Tensor, est: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(B, N) reference, (B, N) estimate -> (B,) scale-invariant SDR in dB (Le Roux et al. 2019); the
    reference first, as in `training.evaluation.metrics.si_sdr` (the score of reports: one signal,
    both made zero-mean; this one is the differentiable training term, on the band-masked waveforms)."""
    alpha = (est * ref).sum(-1, keepdim=True) / ((ref * ref).sum(-1, keepdim=True) + eps)
    target = alpha * ref
    return 10.0 * torch.log10(((target ** 2).sum(-1) + eps) / (((est - target) ** 2).sum(-1) + eps))


def mrstft_loss(est: torch.Tensor, ref: torch.Tensor, resolutions=MRSTFT_RESOLUTIONS) -> torch.Tensor:
    """(B, N) x 2 -> (B,) the multi-resolution STFT loss (spectral convergence plus the mean absolute
    log-magnitude difference, averaged over `resolutions`; Yamamoto et al. 2020), Hann windows."""
    total = 0.0
    for n_fft, hop in resolutions:
        win = torch.hann_window(n_fft, device=est.device)
        e, r = (torch.stft(x, n_fft, hop, n_fft, win, return_complex=True).abs().clamp_min(1e-7) for x in (est, ref))
        sc = torch.linalg.vector_norm(r - e, dim=(-2, -1)) / torch.linalg.vector_norm(r, dim=(-2, -1)).clamp_min(1e-7)
        total = total + sc + (r.log() - e.log()).abs().mean(dim=(-2, -1))
    return total / len(resolutions)


@dataclass(frozen=True)
class LossConfig:
    """The settings of the training objective (`fit`'s loss flags), checked here and only here.

    The loss is the log-magnitude MSE (log(|S| + `loss_floor`), default floor the model's `log_eps`),
    plus `compressed_weight` times the MSE of power-law-compressed magnitudes (|gain * X|^p against
    |S|^p, p = `compressed_power`), which weighs the loud bins that carry speech more than the log
    domain does; plus, on the waveform resynthesised from the gains and the noisy phase (the
    runtime's overlap-add), `sisdr_weight` times the mean -SI-SDR in dB and `mrstft_weight` times the
    multi-resolution STFT loss: terms that see what the noisy phase does to the output, which the
    magnitude terms cannot. `overestimate_weight` (> 1) weighs the magnitude errors of noise left in
    above those of speech removed (`loss_sums`): PESQ's disturbance model penalises added energy
    more than missing energy. `pesq_weight` adds that times the mean of a differentiable model of
    wideband PESQ's disturbance (`training.losses.perceptual`), on the estimated magnitudes; with
    `pesq_compensate` P.862's own level, frequency-response and gain compensations (ablation only).
    `residual_weight` adds that times the compressed magnitudes' squared error of the noise left in
    the noise-dominated bins (`loss_sums`), on top of the terms above. `teacher_weight` adds that
    times the log-magnitude MSE against a teacher model's estimate on the same input (`--teacher`),
    which the caller passes to `__call__`. With `pitch_filter_loss` every term is computed on the
    gains applied after the model's pitch filter, as at inference (`loss_sums`)."""

    loss_floor: float | None = None
    compressed_weight: float = 0.0
    compressed_power: float = COMPRESSED_POWER
    sisdr_weight: float = 0.0
    mrstft_weight: float = 0.0
    overestimate_weight: float = 1.0
    pesq_weight: float = 0.0
    pesq_compensate: bool = False
    residual_weight: float = 0.0
    teacher_weight: float = 0.0
    pitch_filter_loss: bool = False

    def __post_init__(self):
        if not self.overestimate_weight > 0.0:
            raise ValueError(f"overestimate_weight (--overestimate-weight) must be > 0, got {self.overestimate_weight!r}")
        if not self.pesq_weight >= 0.0:
            raise ValueError(f"pesq_weight (--pesq-weight) must be >= 0, got {self.pesq_weight!r}")
        if not self.residual_weight >= 0.0:
            raise ValueError(f"residual_weight (--residual-weight) must be >= 0, got {self.residual_weight!r}")
        if not self.teacher_weight >= 0.0:
            raise ValueError(f"teacher_weight (--teacher-weight) must be >= 0, got {self.teacher_weight!r}")

    def __call__(self, net, core, noisy: torch.Tensor, clean: torch.Tensor, bandwidth: torch.Tensor,
                 autocast, teacher=None) -> torch.Tensor:
        """noisy, clean (B, N) waveforms, bandwidth (B,) -> scalar loss. `net` may be a DDP wrapper of
        `core`; `teacher` is the model of the `teacher_weight` term."""
        if self.teacher_weight > 0.0 and teacher is None:
            raise ValueError("teacher_weight (--teacher-weight) needs a teacher model (--teacher)")
        residual = self.residual_weight > 0.0
        sums = loss_sums(net, core, noisy, clean, bandwidth, autocast, self.loss_floor,
                         self.compressed_power if self.compressed_weight > 0.0 or residual else None,
                         (self.sisdr_weight > 0.0, self.mrstft_weight > 0.0), self.overestimate_weight,
                         self.pesq_weight > 0.0, self.pesq_compensate, residual,
                         teacher if self.teacher_weight > 0.0 else None, self.pitch_filter_loss)
        return sums.loss(self.compressed_weight, self.sisdr_weight, self.mrstft_weight, self.pesq_weight,
                         self.residual_weight, self.teacher_weight)


def batch_loss(net, core, noisy: torch.Tensor, clean: torch.Tensor, bandwidth: torch.Tensor, autocast,
               loss_floor: float | None = None, compressed_weight: float = 0.0,
               compressed_power: float = COMPRESSED_POWER, sisdr_weight: float = 0.0,
               mrstft_weight: float = 0.0, overestimate_weight: float = 1.0, pesq_weight: float = 0.0,
               pesq_compensate: bool = False, residual_weight: float = 0.0) -> torch.Tensor:
    """noisy, clean (B, N) waveforms, bandwidth (B,) -> the scalar loss of `LossConfig` with these
    settings. `net` may be a DDP wrapper of `core`."""
    config = LossConfig(loss_floor, compressed_weight, compressed_power, sisdr_weight, mrstft_weight,
                        overestimate_weight, pesq_weight, pesq_compensate, residual_weight)
    return config(net, core, noisy, clean, bandwidth, autocast)


_PESQ_MODELS: dict = {}


def pesq_model(cfg: STFTConfig, device, compensate: bool = False) -> PesqModel:
    """The P.862 model for the model's STFT (its window's power), built once per device. The
    training term is the uncompensated one (`PesqModel`: the estimate on the clean speech's level
    alignment, no frequency-response or gain compensation), which an estimate cannot satisfy by
    colouring or attenuating the speech."""
    key = (cfg.n_fft, cfg.sample_rate, str(device), compensate)
    if key not in _PESQ_MODELS:
        win = features.window(cfg)
        _PESQ_MODELS[key] = PesqModel(float((win * win).sum()), cfg.n_fft, cfg.sample_rate, compensate).to(device)
    return _PESQ_MODELS[key]


def compressed(mag: torch.Tensor, power: float) -> torch.Tensor:
    """|X|^power, with a floor far below anything audible so that the gradient stays finite at 0."""
    return mag.clamp_min(1e-6) ** power


def weighted_sq_err(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum of w * (a - b)^2."""
    return (((a - b) ** 2) * w).sum()


def feature_stats(synth: Synthesizer, n_examples: int, cfg: ModelConfig, batch: int = 32):
    """Per-bin mean and std of the noisy log-magnitude over `n_examples` examples."""
    s1 = torch.zeros(cfg.n_freqs, dtype=torch.float64)
    s2 = torch.zeros(cfg.n_freqs, dtype=torch.float64)
    count = 0
    for start in range(0, n_examples, batch):
        noisy, _, _ = synth.batch(range(start, min(start + batch, n_examples)))
        x = features.log_magnitude(features.stft(torch.from_numpy(noisy), cfg.stft), cfg.log_eps).double()  # (B, T, F)
        s1 += x.sum(dim=(0, 1))
        s2 += (x * x).sum(dim=(0, 1))
        count += x.shape[0] * x.shape[1]
    mean = s1 / count
    std = (s2 / count - mean * mean).clamp_min(1e-6).sqrt()
    return mean.float(), std.float()
