"""What the dev sets' file names say: `snr-05_music_0007.wav` is a -5 dB mixture with music,
`real_p287_001.wav` a real recorded pair (`training.evaluation.devset` writes these names)."""
from __future__ import annotations

import re
from pathlib import Path

KINDS = ("noise", "music", "babble", "real")
_KIND = re.compile(r"_(noise|music|babble)_")


def kind_of(name: str) -> str | None:
    """"noise", "music", "babble", "real", or None for a name that says none."""
    base = Path(name).name
    if base.startswith("real_"):
        return "real"
    m = _KIND.search(base)
    return m.group(1) if m else None
