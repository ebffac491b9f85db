"""File in, file out: any format libsndfile reads, the same format, rate and channels out, processed
in blocks through the streaming core so that memory stays bounded on hour-long files."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from .errors import AudioDecodeError

BLOCK_SECONDS = 10.0


def audio_extensions() -> set[str]:
    import soundfile as sf

    exts = {f".{k.lower()}" for k in sf.available_formats()}
    return exts | {".oga", ".opus", ".mp3", ".aif", ".aiff"}


def find_audio(inputs: list[Path]) -> list[tuple[Path, Path]]:
    """(file, path relative to its input root) for each audio file under the inputs."""
    exts = audio_extensions()
    found = []
    for root in inputs:
        if root.is_dir():
            for p in sorted(root.rglob("*")):
                if p.is_file() and p.suffix.lower() in exts:
                    found.append((p, p.relative_to(root)))
        elif root.is_file():
            found.append((root, Path(root.name)))
        else:
            raise FileNotFoundError(f"no such file or folder: {root}")
    return found


def enhance_file(enhancer, src: Path, dst: Path, atten_lim_db=None, progress: Callable[[int], None] | None = None) -> dict:
    """Enhance `src` into `dst` (same container, subtype, rate and channels). Returns file facts."""
    import soundfile as sf

    try:
        f = sf.SoundFile(str(src))
    except (sf.LibsndfileError, RuntimeError) as e:
        raise AudioDecodeError(f"{src}: not readable audio ({e})") from None
    with f:
        if f.frames == 0:
            raise AudioDecodeError(f"{src}: empty audio (0 samples)")
        sr, ch = f.samplerate, f.channels
        stream = enhancer.stream(sr, ch, atten_lim_db)
        clip = not f.subtype.startswith(("FLOAT", "DOUBLE"))
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(dst.name + ".part")
        n_out = 0
        with sf.SoundFile(str(tmp), "w", sr, ch, subtype=f.subtype, endian=f.endian, format=f.format) as g:
            def write(y: np.ndarray) -> None:
                nonlocal n_out
                y = y.reshape(-1, ch)
                g.write(np.clip(y, -1.0, 1.0) if clip else y)
                n_out += y.shape[0]

            for block in f.blocks(blocksize=int(BLOCK_SECONDS * sr), dtype="float32", always_2d=True):
                write(stream.feed(block if ch > 1 else block[:, 0]))
                if progress:
                    progress(block.shape[0])
            write(stream.flush())
        tmp.replace(dst)
        return {"path": str(dst), "sample_rate": sr, "channels": ch, "frames": n_out, "format": f.format, "subtype": f.subtype}
