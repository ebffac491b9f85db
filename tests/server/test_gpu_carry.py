"""`tools.gpu_carry`'s fatbin trimming: only the kernels of other GPU architectures are zeroed."""
from __future__ import annotations

import struct

from tools.gpu_carry import FATBIN_MAGIC, fatbin_entries, keep_arch


def _entry(kind: int, sm: int, payload: bytes) -> bytes:
    header = bytearray(64)
    struct.pack_into("<HHIQ", header, 0, kind, 0x101, 64, len(payload))
    struct.pack_into("<I", header, 28, sm)
    return bytes(header) + payload


def test_keep_arch_zeroes_the_other_architectures_only():
    entries = _entry(2, 80, b"\x11" * 40) + _entry(2, 90, b"\x22" * 24) + _entry(1, 120, b"\x33" * 8)
    blob = FATBIN_MAGIC + struct.pack("<HHQ", 1, 16, len(entries)) + entries
    elf = b"\x7fELF" + b"\x00" * 60 + blob + b"tail"
    assert [(size, kind, sm) for _, size, kind, sm in fatbin_entries(elf)] == [(40, 2, 80), (24, 2, 90), (8, 1, 120)]
    out, kept, zeroed = keep_arch(elf, 90)
    assert (kept, zeroed, len(out)) == (1, 48, len(elf))
    assert b"\x22" * 24 in out and b"\x11" not in out and b"\x33" not in out
    assert out.endswith(b"tail") and out[:64] == elf[:64]
