"""What `make gpu-check` needs on a GPU machine that has no package index, in a folder to carry there
(`gpu-serve/`, ignored by git):

    python -m tools.gpu_carry --out gpu-serve [--python 3.12] [--arch 90]

- onnxruntime-gpu (the `[gpu]` pin) unpacked, with the CUDA provider's kernels for other GPU
  architectures than `--arch` zeroed (sm_90: H100 and H200; the driver picks its own
  architecture's kernels and never reads the others), without the TensorRT provider and the C
  library the Python module does not load, packed as tar.xz in pieces of `--piece-mib` (a carry
  of at most 64 MiB per call with the working tree): about 60 MB instead of 255;
- the serving dependencies as wheels for that Python (not numpy: the machine has one);
- the GPU graph, `tim-gpu.onnx`: models/tim.pt exported with float key/value rings (needs torch).

Each piece's sha256 goes to `gpu-serve/SHA256SUMS`.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import struct
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import tomllib

from . import REPO_ROOT

FATBIN_MAGIC = struct.pack("<I", 0xBA55ED50)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "any")
DROP = ("onnxruntime/capi/libonnxruntime_providers_tensorrt.so",)  # not used by the CUDA provider
DROP_PREFIX = ("onnxruntime/capi/libonnxruntime.so",)  # the C API library; the Python module links its own


def fatbin_entries(data: bytes) -> list[tuple[int, int, int, int]]:
    """(payload offset, payload size, kind, sm) of every entry of every CUDA fatbin in an ELF
    file's bytes (kind 1: PTX, 2: machine code)."""
    out, pos = [], 0
    while (i := data.find(FATBIN_MAGIC, pos)) >= 0:
        _version, header, size = struct.unpack_from("<HHQ", data, i + 4)
        if header != 16 or size > len(data):
            pos = i + 4
            continue
        e, end = i + header, i + header + size
        while e < end:
            kind, _v, ehs, psz = struct.unpack_from("<HHIQ", data, e)
            if ehs == 0 or ehs > 1024:
                break
            out.append((e + ehs, psz, kind, struct.unpack_from("<I", data, e + 28)[0]))
            e += ehs + psz
        pos = end
    return out


def keep_arch(data: bytes, arch: int) -> tuple[bytes, int, int]:
    """`data` with the payloads of fatbin entries for other architectures zeroed; (bytes, entries
    kept, bytes zeroed)."""
    buf = bytearray(data)
    kept = zeroed = 0
    for off, size, _kind, sm in fatbin_entries(data):
        if sm == arch:
            kept += 1
        else:
            buf[off:off + size] = bytes(size)
            zeroed += size
    return bytes(buf), kept, zeroed


def pip_download(specs: list[str], dest: Path, python: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version", python,
           "--implementation", "cp", "-d", str(dest)]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    subprocess.run(cmd + specs, check=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.gpu_carry", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(REPO_ROOT / "gpu-serve"))
    p.add_argument("--python", default="3.12", help="the GPU machine's Python (major.minor)")
    p.add_argument("--arch", type=int, default=90, help="the GPU's architecture (sm_NN): 90 for H100 and H200")
    p.add_argument("--piece-mib", type=int, default=57)
    p.add_argument("--checkpoint", default=str(REPO_ROOT / "models" / "tim.pt"))
    a = p.parse_args(argv)
    out = Path(a.out)
    (out / "wheels").mkdir(parents=True, exist_ok=True)
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    ort_pin = next(r for r in project["optional-dependencies"]["gpu"] if r.startswith("onnxruntime-gpu"))
    ort_pin = ort_pin.replace("[cuda,cudnn]", "")
    with tempfile.TemporaryDirectory() as tmp:
        pip_download(["--no-deps", ort_pin], Path(tmp), a.python)
        wheel = next(Path(tmp).glob("onnxruntime_gpu-*.whl"))
        packed = io.BytesIO()
        with zipfile.ZipFile(wheel) as z, tarfile.open(fileobj=packed, mode="w:xz", preset=9) as tar:
            for info in z.infolist():
                if info.is_dir() or info.filename in DROP or info.filename.startswith(DROP_PREFIX):
                    continue
                data = z.read(info)
                if info.filename.endswith("libonnxruntime_providers_cuda.so"):
                    data, kept, zeroed = keep_arch(data, a.arch)
                    print(f"CUDA provider: kept {kept} sm_{a.arch} kernels, zeroed {zeroed / 1e6:.0f} MB of others")
                t = tarfile.TarInfo(info.filename)
                t.size, t.mode = len(data), 0o755 if info.filename.endswith(".so") else 0o644
                tar.addfile(t, io.BytesIO(data))
    for old in out.glob("onnxruntime-gpu.tar.xz.part*"):
        old.unlink()
    blob, piece = packed.getvalue(), a.piece_mib << 20
    sums = []
    for i in range(0, len(blob), piece):
        name = f"onnxruntime-gpu.tar.xz.part{chr(97 + i // piece // 26)}{chr(97 + i // piece % 26)}"
        (out / name).write_bytes(blob[i:i + piece])
        sums.append(f"{hashlib.sha256(blob[i:i + piece]).hexdigest()}  {name}")
    print(f"onnxruntime-gpu: {len(blob) / 1e6:.1f} MB in {len(sums)} piece(s)")
    for old in (out / "wheels").glob("*.whl"):
        old.unlink()
    serving = project["dependencies"] + project["optional-dependencies"]["serve"] + ["httpx==0.28.1"]
    pip_download([r for r in serving if not r.startswith(("numpy", "uvloop"))], out / "wheels", a.python)
    for w in (out / "wheels").glob("numpy-*.whl"):
        w.unlink()
    subprocess.run([sys.executable, "-m", "enhancer", "export", a.checkpoint, "-o", str(out / "tim-gpu.onnx"),
                    "--fp16", "-q"], check=True, stdout=subprocess.DEVNULL)
    (out / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    print(f"{out}: the pieces, {len(list((out / 'wheels').glob('*.whl')))} wheels and tim-gpu.onnx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
