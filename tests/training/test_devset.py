"""Dev test set: built from the validation split only, evenly over SNRs, reproducible by seed."""
import numpy as np
import soundfile as sf

from training.data.mixing import snr_db
from training.evaluation.devset import build_devset


def test_devset_is_reproducible_and_uses_validation_data(corpus, tmp_path):
    real = tmp_path / "real"
    for kind in ("noisy", "clean"):
        (real / kind).mkdir(parents=True)
        sf.write(real / kind / "p1.wav", np.full(1600, 0.1 if kind == "noisy" else 0.05, np.float32), 16000)
    a = build_devset(corpus, tmp_path / "a", n=10, seconds=(1.0, 1.5), real_pairs=real, cache_root=tmp_path / "c", log=lambda m: None)
    b = build_devset(corpus, tmp_path / "b", n=10, seconds=(1.0, 1.5), real_pairs=real, cache_root=tmp_path / "c", log=lambda m: None)
    names = sorted(p.name for p in (a / "noisy").glob("*.wav"))
    assert names == sorted(p.name for p in (a / "clean").glob("*.wav"))
    assert len(names) == 11 and "real_p1.wav" in names
    assert sorted(n[:5] for n in names if n.startswith("snr")) == sorted(["snr00", "snr05", "snr10", "snr15", "snr20"] * 2)
    rows = [line.split("\t") for line in (a / "manifest.tsv").read_text().splitlines()[1:]]
    speakers = {r[4] for r in rows if not r[0].startswith("real")}
    assert speakers <= {"libri 23", "kde nl"}  # validation speakers only
    for name in names:
        x, sr = sf.read(a / "noisy" / name)
        y, _ = sf.read(b / "noisy" / name)
        assert sr == 16000 and np.array_equal(x, y)
    for r in rows:
        if r[0].startswith("snr") and r[3] != "none":
            noisy, _ = sf.read(a / "noisy" / r[0])
            clean, _ = sf.read(a / "clean" / r[0])
            assert 1.0 <= len(clean) / 16000 <= 1.5
            assert abs(snr_db(clean, noisy - clean) - float(r[1])) < 0.5  # 16-bit rounding of both files


def test_devset_command_reports_a_missing_corpus(tmp_path, capsys):
    from training.cli import main

    assert main(["devset", "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "dev")]) == 2
    assert "data folder not found" in capsys.readouterr().err
    assert not (tmp_path / "dev").exists()
