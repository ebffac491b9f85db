"""DNSMOS P.835 (SIG, BAK, OVRL): a non-intrusive quality estimate, no clean reference needed.

Follows `../shared/data/dnsmos/NOTES.md`: 16 kHz mono; a clip shorter than 9.01 s is tiled to at
least 144160 samples; windows of 144160 samples start every second, their count being
`int(floor(n / 16000) - 9.01) + 1` (windows running past the end are skipped); each raw window goes
into `DNSMOS/sig_bak_ovr.onnx` as is; the raw outputs are calibrated per window with the quadratic
polynomials below and averaged over the windows. `personalized=True` uses the pDNSMOS model, which
also penalises interfering talkers.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

INPUT_RATE = 16000  # the DNSMOS models' input rate
WINDOW = 144160  # 9.01 s
INPUT_SECONDS = 9.01

# calibration polynomials, highest power first
P835 = {"sig": (-0.08397278, 1.22083953, 0.0052439), "bak": (-0.13166888, 1.60915514, -0.39604546),
        "ovrl": (-0.06766283, 1.11546468, 0.04602535)}
P835_PERSONALIZED = {"sig": (-0.01019296, 0.02751166, 1.19576786, -0.24348726),
                     "bak": (-0.04976499, 0.44276479, -0.1644611, 0.96883132),
                     "ovrl": (-0.00533021, 0.005101, 1.18058466, -0.11236046)}


class DNSMOS:
    def __init__(self, folder, personalized: bool = False, threads: int = 1):
        import onnxruntime as ort

        folder = Path(folder)
        path = folder / ("pDNSMOS" if personalized else "DNSMOS") / "sig_bak_ovr.onnx"
        if not path.is_file():
            raise FileNotFoundError(f"DNSMOS model not found: {path} (expected the folder of ../shared/data/dnsmos)")
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        self.input = self.session.get_inputs()[0].name
        self.poly = P835_PERSONALIZED if personalized else P835

    @staticmethod
    def windows(audio: np.ndarray) -> np.ndarray:
        """(n,) 16 kHz -> (W, 144160) analysis windows."""
        x = np.asarray(audio, dtype=np.float32)
        if x.ndim != 1 or not len(x):
            raise ValueError(f"DNSMOS needs a non-empty mono signal, got shape {x.shape}")
        while len(x) < WINDOW:
            x = np.concatenate([x, x])
        count = int(np.floor(len(x) / INPUT_RATE) - INPUT_SECONDS) + 1
        starts = [i * INPUT_RATE for i in range(count) if i * INPUT_RATE + WINDOW <= len(x)]
        return np.stack([x[s:s + WINDOW] for s in starts])  # (W, 144160)

    def score(self, audio: np.ndarray) -> dict[str, float]:
        """{"sig", "bak", "ovrl"} calibrated, and the raw means {"sig_raw", ...} of a 16 kHz clip."""
        w = self.windows(audio)
        raw = np.concatenate([self.session.run(None, {self.input: w[i:i + 8]})[0] for i in range(0, len(w), 8)])  # (W, 3)
        out = {}
        for j, name in enumerate(("sig", "bak", "ovrl")):
            out[name] = float(np.polyval(self.poly[name], raw[:, j].astype(np.float64)).mean())
            out[name + "_raw"] = float(raw[:, j].mean())
        return out
