"""A differentiable model of wideband PESQ's disturbance (ITU-T P.862 / P.862.2), on the model's
own STFT magnitudes, for use as an auxiliary training loss (`--pesq-weight`).

The 16 kHz model of P.862 frames the signal with 32 ms windows at a 16 ms hop: the model's own
framing (512 points, 256 hop), so the term works on the estimated and clean magnitudes directly,
with no resynthesis. From the standard, in order:

1. level alignment: each signal scaled so that its power between 325 Hz and 3.25 kHz is 10^7
   (here per frame from the spectrum, with Parseval, on the scale of P.862's Hann window);
2. the wideband input filter (P.862.2's 100 Hz high-pass, as its biquad's response per bin);
3. the Bark power spectrum: 49 bands, rectangular groups of bins, P.862's density correction;
4. partial compensation of the system's frequency response (the reference's bands scaled by the
   degraded/reference ratio of the mean audible power over speech frames, within 0.01..100);
5. compensation of short-term gain changes (the degraded frames scaled by the ratio of the audible
   power, smoothed over two frames, within 3e-4..5);
6. Zwicker loudness per band above the hearing threshold;
7. the disturbance: the loudness difference less a dead zone of a quarter of the smaller loudness;
   symmetric (Bark-width-weighted L2 over bands) and asymmetric (L1 after the factor
   ((P_deg + 50) / (P_ref + 50))^1.2, 0 below 3, at most 12: added energy costs more than missing);
8. frame weighting by the reference's loudness, capped at 45; L6 over 20-frame intervals (hop 10),
   then L2 over the intervals;
9. raw score 4.5 - 0.1 d_sym - 0.0309 d_asym, mapped to MOS-LQO by P.862.2's logistic.

What it leaves out: time alignment (the estimate is frame-aligned with the clean speech by
construction) and the recursive smoothing of step 5 (here one step). Steps 1 (for the estimate), 4
and 5 make the score forgive colouring and attenuating the speech; trained on, they let a model
suppress far harder than it should (on the unseen dev set: PESQ-WB +0.36 but SI-SDR -8.6 dB, DNSMOS
OVRL -0.20, 4-15 dB removed from speech bands). The training term (`PesqModel(compensate=False)`,
`training.losses.objective.pesq_model`) therefore aligns the estimate with the clean speech's factor and
compensates nothing. The loss is
0.1 d_sym + 0.0309 d_asym: 4.5 minus the raw score, lower is better. The constants are P.862's
published tables for 16 kHz."""
from __future__ import annotations

import math

import numpy as np
import torch

N_FFT = 512
SAMPLE_RATE = 16000
LEVEL_TARGET = 1e7  # P.862: the power each signal is aligned to, in the 325 Hz .. 3.25 kHz band
LEVEL_BAND_HZ = (325.0, 3250.0)
HANN_POWER = 192.0  # sum of a 512-point Hann window squared (P.862's analysis window)
# P.862.2's wideband input filter, a 100 Hz high-pass biquad (b0, b1, b2), (1, a1, a2)
WB_FILTER_B = (2.740826, -5.4816519, 2.740826)
WB_FILTER_A = (1.0, -1.9444777, 0.94597794)

# P.862, 16 kHz: FFT bins per Bark band (bins 0..255), band widths in Bark, band centres in Bark,
# power density correction factors, absolute hearing thresholds, and the two scale factors.
BINS_PER_BAND = (
    1, 1, 1, 1, 1, 1, 1, 1, 2, 1, 1, 1, 1, 1, 2, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 4,
    3, 4, 5, 4, 5, 6, 6, 7, 8, 9, 9, 12, 12, 15, 16, 18, 21, 25, 20)
WIDTH_BARK = (
    0.157344, 0.317994, 0.322441, 0.326934, 0.331474, 0.336061, 0.340697, 0.345381, 0.350114, 0.354897,
    0.359729, 0.364611, 0.369544, 0.374529, 0.379565, 0.384653, 0.389794, 0.394989, 0.400236, 0.405538,
    0.410894, 0.416306, 0.421773, 0.427297, 0.432877, 0.438514, 0.444209, 0.449962, 0.455774, 0.461645,
    0.467577, 0.473569, 0.479621, 0.485736, 0.491912, 0.498151, 0.504454, 0.510819, 0.517250, 0.523745,
    0.530308, 0.536934, 0.543629, 0.550390, 0.557220, 0.564119, 0.571085, 0.578125, 0.585232)
CENTRE_BARK = (
    0.078672, 0.316341, 0.636559, 0.961246, 1.290450, 1.624217, 1.962597, 2.305636, 2.653383, 3.005889,
    3.363201, 3.725371, 4.092449, 4.464486, 4.841533, 5.223642, 5.610866, 6.003256, 6.400869, 6.803755,
    7.211971, 7.625571, 8.044611, 8.469146, 8.899232, 9.334927, 9.776288, 10.223374, 10.676242, 11.134952,
    11.599563, 12.070135, 12.546731, 13.029408, 13.518232, 14.013264, 14.514566, 15.022202, 15.536238,
    16.056736, 16.583761, 17.117382, 17.657663, 18.204674, 18.758478, 19.319147, 19.886751, 20.461355,
    21.043034)
POW_DENS_CORRECTION = (
    100.000000, 99.999992, 100.000000, 100.000008, 100.000008, 100.000015, 99.999992, 99.999969, 50.000027,
    100.000000, 99.999969, 100.000015, 99.999947, 100.000061, 53.047077, 110.000046, 117.991989, 65.000000,
    68.760147, 69.999931, 71.428818, 75.000038, 76.843384, 80.968781, 88.646126, 63.864388, 68.155350,
    72.547775, 75.584831, 58.379192, 80.950836, 64.135651, 54.384785, 73.821884, 64.437073, 59.176456,
    65.521278, 61.399822, 58.144047, 57.004543, 64.126297, 54.311001, 61.114979, 55.077751, 56.849335,
    55.628868, 53.137054, 54.985844, 79.546974)
ABS_THRESH_POWER = (
    51286152.0, 2454709.5, 70794.59375, 4897.788574, 1174.897705, 389.045166, 104.71286, 45.70882,
    17.782795, 9.772372, 4.897789, 3.090296, 1.905461, 1.258925, 0.977237, 0.724436, 0.562341, 0.457088,
    0.389045, 0.331131, 0.295121, 0.269153, 0.25704, 0.251189, 0.251189, 0.251189, 0.251189, 0.263027,
    0.288403, 0.30903, 0.338844, 0.371535, 0.398107, 0.436516, 0.467735, 0.489779, 0.501187, 0.501187,
    0.512861, 0.524807, 0.524807, 0.524807, 0.512861, 0.47863, 0.42658, 0.371535, 0.363078, 0.416869,
    0.537032)
SP = 6.910853e-6
SL = 1.866055e-1
ZWICKER_POWER = 0.23


class PesqModel(torch.nn.Module):
    """magnitudes (B, T, 257) of the 512-point STFT at 16 kHz -> P.862's disturbances (module doc).

    `compensate` (the standard's behaviour) aligns each signal's level on its own and compensates
    the frequency response and short-term gain of the degraded signal: a score that forgives
    colouring and attenuating the speech. As a training loss that is an invitation to do both
    (suppress harder, pay nothing for the speech removed with the noise); `compensate=False` scales
    the estimate by the clean speech's alignment factor and compensates nothing, so every dB of
    speech lost or coloured counts as loudness disturbance.

    The tables are buffers, so `.to(device)` moves them; everything runs in float32."""

    def __init__(self, window_power: float = HANN_POWER, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE,
                 compensate: bool = True):
        super().__init__()
        self.compensate = compensate
        if n_fft != N_FFT or sample_rate != SAMPLE_RATE:
            raise ValueError(f"the P.862 model needs a {N_FFT}-point STFT at {SAMPLE_RATE} Hz, "
                             f"got {n_fft} points at {sample_rate} Hz")
        n_freqs = n_fft // 2 + 1
        freqs = np.arange(n_freqs) * sample_rate / n_fft
        # Parseval: the one-sided sum of |X|^2 of a frame is n_fft * sum(w^2) / 2 times the signal's
        # power; aligning that to n_fft * HANN_POWER / 2 * LEVEL_TARGET puts any window on P.862's scale
        self.level_target = n_fft * HANN_POWER / 2.0 * LEVEL_TARGET
        self.window_ratio = HANN_POWER / window_power
        level_band = (freqs >= LEVEL_BAND_HZ[0]) & (freqs <= LEVEL_BAND_HZ[1])
        z = np.exp(-1j * 2.0 * math.pi * freqs / sample_rate)
        h = np.polyval(WB_FILTER_B[::-1], z) / np.polyval(WB_FILTER_A[::-1], z)
        fbank = np.zeros((n_freqs, len(BINS_PER_BAND)), dtype=np.float32)
        start = 0
        for band, count in enumerate(BINS_PER_BAND):
            fbank[start:start + count, band] = 1.0
            start += count
        fbank[0, :] = 0.0  # P.862 leaves the DC bin out
        widths = np.asarray(WIDTH_BARK, dtype=np.float64)
        thresh = np.asarray(ABS_THRESH_POWER, dtype=np.float64)
        exponent = np.clip(6.0 / (np.asarray(CENTRE_BARK) + 2.0), 1.0, 2.0) ** 0.15 * ZWICKER_POWER
        self.register_buffer("level_band", torch.from_numpy(level_band.astype(np.float32)))
        self.register_buffer("input_filter", torch.from_numpy((np.abs(h) ** 2).astype(np.float32)))
        self.register_buffer("fbank", torch.from_numpy(fbank * (np.asarray(POW_DENS_CORRECTION) * SP)[None, :]
                                                       .astype(np.float32)))
        self.register_buffer("thresh", torch.from_numpy(thresh.astype(np.float32)))
        self.register_buffer("exponent", torch.from_numpy(exponent.astype(np.float32)))
        self.register_buffer("loud_scale", torch.from_numpy(((2.0 * thresh) ** exponent * SL).astype(np.float32)))
        total = widths[1:].sum()  # band 0 (below the 100 Hz filter) is left out of the norms
        self.register_buffer("w_l2", torch.from_numpy((np.r_[0.0, widths[1:]] / total ** 0.5).astype(np.float32)))
        self.register_buffer("w_l1", torch.from_numpy((np.r_[0.0, widths[1:]] / total).astype(np.float32)))
        self.total_width = float(total)

    def bark(self, mag: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, F) magnitudes -> (B, T, 49) Bark power densities on P.862's scale and the (B,)
        level-alignment factor: the given `scale`, or the one that aligns this signal."""
        power = mag.float() ** 2 * self.window_ratio
        if scale is None:
            level = (power * self.level_band).sum(-1).mean(-1)  # (B,) in-band power per frame
            scale = self.level_target / level.clamp_min(1e-20)
        power = power * scale[:, None, None] * self.input_filter
        return power @ self.fbank, scale

    def audible(self, bark: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
        """(B, T, 49) -> (B, T): the power of the bands above `factor` times the hearing threshold."""
        return torch.where(bark > self.thresh * factor, bark, torch.zeros_like(bark)).sum(-1)

    def loudness(self, bark: torch.Tensor) -> torch.Tensor:
        """(B, T, 49) Bark powers -> Zwicker loudness densities (sone/Bark), 0 below the threshold."""
        ratio = (0.5 + 0.5 * bark / self.thresh).clamp_min(1.0)
        loud = self.loud_scale * (ratio ** self.exponent - 1.0)
        return torch.where(bark > self.thresh, loud, torch.zeros_like(loud))

    def disturbances(self, est_mag: torch.Tensor, clean_mag: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, F) estimate and clean magnitudes -> (B,) d_sym, (B,) d_asym."""
        ref, scale = self.bark(clean_mag)
        deg, _ = self.bark(est_mag, None if self.compensate else scale)
        if self.compensate:
            ref, deg = self._compensate(ref, deg)
        loud_deg, loud_ref = self.loudness(deg), self.loudness(ref)
        diff = loud_deg - loud_ref
        dead = 0.25 * torch.minimum(loud_deg, loud_ref)
        dist = torch.sign(diff) * (diff.abs() - dead).clamp_min(0.0)
        asym = ((deg + 50.0) / (ref + 50.0)) ** 1.2
        asym = torch.where(asym < 3.0, torch.zeros_like(asym), asym.clamp_max(12.0))
        d_sym = self.total_width * ((dist * self.w_l2) ** 2).sum(-1).clamp_min(1e-20).sqrt()  # (B, T)
        d_asym = self.total_width * ((dist * asym).abs() * self.w_l1).sum(-1)
        h = ((self.audible(ref) + 1e5) / 1e7) ** 0.04
        d_sym, d_asym = (d_sym / h).clamp_max(45.0), (d_asym / h).clamp_max(45.0)
        return aggregate(d_sym), aggregate(d_asym)

    def _compensate(self, ref: torch.Tensor, deg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """P.862's partial compensation of the frequency response (on the reference) and of
        short-term gain changes (on the degraded signal), over the Bark powers (B, T, 49)."""
        speech = (self.audible(ref, 1e2) >= 1e7).float()  # P.862's non-silent frames

        def band_mean(x: torch.Tensor) -> torch.Tensor:  # audible power over the speech frames, per band
            x = torch.where(x > self.thresh * 1e2, x, torch.zeros_like(x)) * speech[..., None]
            return x.sum(1) / speech.sum(1).clamp_min(1.0)[:, None]

        ratio = ((band_mean(deg) + 1000.0) / (band_mean(ref) + 1000.0)).clamp(0.01, 100.0)
        ref = ref * ratio[:, None, :]
        gain = (self.audible(ref) + 5e3) / (self.audible(deg) + 5e3)  # (B, T)
        gain = torch.cat([gain[:, :1], 0.8 * gain[:, 1:] + 0.2 * gain[:, :-1]], dim=1).clamp(3e-4, 5.0)
        return ref, deg * gain[..., None]

    def loss(self, est_mag: torch.Tensor, clean_mag: torch.Tensor) -> torch.Tensor:
        """(B,) 0.1 d_sym + 0.0309 d_asym: 4.5 minus P.862's raw score."""
        d_sym, d_asym = self.disturbances(est_mag, clean_mag)
        return 0.1 * d_sym + 0.0309 * d_asym

    def mos(self, est_mag: torch.Tensor, clean_mag: torch.Tensor) -> torch.Tensor:
        """(B,) the model's MOS-LQO (P.862.2's mapping of the raw score)."""
        raw = 4.5 - self.loss(est_mag, clean_mag)
        return 0.999 + 4.0 / (1.0 + torch.exp(-1.3669 * raw + 3.8224))


def aggregate(d: torch.Tensor, span: int = 20, hop: int = 10) -> torch.Tensor:
    """(B, T) frame disturbances -> (B,): L6 over `span`-frame intervals every `hop` (one interval
    of all T frames when T <= span), then L2."""
    windows = d.unfold(1, min(span, d.shape[1]), hop)  # (B, K, span)
    intervals = windows.pow(6).mean(-1).clamp_min(1e-30).pow(1.0 / 6.0)
    return intervals.pow(2).mean(1).sqrt()
