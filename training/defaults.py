"""Default places of the data that lives beside a source checkout (`../shared/data`): the
DNSMOS models and the real Voicebank+DEMAND p287 pairs; and the corpus root the documented commands
name (`../enhancer-data`). Only the command lines read them, and pass them to the commands as the
defaults of their flags; no other module knows these paths."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent  # the repository this package runs from
SHARED_DATA = CHECKOUT.parent / "shared" / "data"


@dataclass(frozen=True)
class Defaults:
    dnsmos_dir: Path | None  # DNSMOS models (eval, fit --dev); None: not there
    real_pairs: Path  # noisy/ and clean/ real recordings added to the dev sets (devset)
    corpus: Path = CHECKOUT.parent / "enhancer-data"  # a corpus root (manifests/ and audio), e.g. peers.fullband --data

    @classmethod
    def beside_checkout(cls, shared_data: Path = SHARED_DATA) -> Defaults:
        dnsmos = shared_data / "dnsmos"
        return cls(dnsmos_dir=dnsmos if dnsmos.is_dir() else None,
                   real_pairs=shared_data / "dev" / "valentini_p287")


def default_dnsmos_dir() -> Path | None:
    """The DNSMOS models beside the checkout, or None."""
    return Defaults.beside_checkout().dnsmos_dir
