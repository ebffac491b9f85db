"""Layout readers on small generated fixtures with the real folder and file naming."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from tests.conftest import speechlike
from training.data import layouts
from training.data.audio_cache import read16k
from training.data.manifests import DataError, Item, read_manifest, write_manifest


def test_corpus_layout_reads_all_manifests(corpus):
    data = layouts.corpus_layout(corpus)
    assert {len(data.train[c]) for c in ("speech",)} == {15}
    assert len(data.valid["speech"]) == 6 and len(data.train["noise"]) == 4 and len(data.valid["music"]) == 1
    g722 = [it for it in data.train["speech"] if it.group == "g722 en"]
    assert g722 and all(it.bandwidth_hz == 7000 for it in g722) and g722[0].source == "g722"
    assert all(it.path.startswith(str(corpus)) for it in data.train["speech"])
    assert not {it.group for it in data.train["speech"]} & {it.group for it in data.valid["speech"]}


def test_corpus_layout_errors(tmp_path, corpus):
    with pytest.raises(DataError, match="not found"):
        layouts.corpus_layout(tmp_path / "nope")
    with pytest.raises(DataError, match="manifests/"):
        layouts.corpus_layout(tmp_path)
    (tmp_path / "manifests").mkdir()
    (tmp_path / "manifests" / "speech_train.tsv").write_text("path\tseconds\n")
    with pytest.raises(DataError, match="lists no files"):
        read_manifest(tmp_path / "manifests" / "speech_train.tsv")
    (tmp_path / "bad.tsv").write_text("file\tseconds\na.wav\t1\n")
    with pytest.raises(DataError, match="'path' column"):
        read_manifest(tmp_path / "bad.tsv")


def test_manifest_roundtrip_tsv_and_jsonl(tmp_path):
    items = [Item(str(tmp_path / "a.wav"), 1.5, 16000, "spk 1", 8000.0), Item(str(tmp_path / "b" / "c.flac"), 2.0, 44100, "spk 2", 22050.0)]
    write_manifest(items, tmp_path / "m.tsv", root=tmp_path)
    assert "b/c.flac" in (tmp_path / "m.tsv").read_text()
    assert read_manifest(tmp_path / "m.tsv") == items
    lines = ['{"path": "a.wav", "seconds": 1.5, "sample_rate": 16000, "group": "spk 1", "bandwidth_hz": 8000}', ""]
    (tmp_path / "m.jsonl").write_text("\n".join(lines))
    assert read_manifest(tmp_path / "m.jsonl") == items[:1]


def _dns_fixture(root):
    ds = root / "datasets"
    (ds / "clean").mkdir(parents=True)
    for i, reader in enumerate(("00001", "00001", "00002", "00003", "00004", "00005")):
        sf.write(str(ds / "clean" / f"book_{i:05d}_chp_0009_reader_{reader}_{i}.wav"), speechlike(8000, seed=i), 16000)
    (ds / "noise").mkdir(parents=True)
    for name in ("-2iv1pHPoUc", "Door_knock_01", "AirConditioner_3"):
        sf.write(str(ds / "noise" / f"{name}.wav"), (0.05 * np.random.default_rng(1).standard_normal(8000)).astype(np.float32), 16000)
    test = ds / "test_set" / "synthetic" / "no_reverb"
    (test / "clean").mkdir(parents=True)
    (test / "noisy").mkdir(parents=True)
    for fid, noisy_name in ((0, "clnsp1_train_69005_1_snr15_tl-21_fileid_0.wav"), (12, "clnsp52_amMeH4u6AO4_snr5_tl-18_fileid_12.wav"),
                            (3, "clnsp44_wind_97396_2_snr14_tl-26_fileid_3.wav")):
        x = speechlike(16000, seed=fid)
        sf.write(str(test / "clean" / f"clean_fileid_{fid}.wav"), x, 16000)
        sf.write(str(test / "noisy" / noisy_name), x + 0.01, 16000)
    return ds


def test_dns_layout_training_lists_and_test_pairs(tmp_path):
    ds = _dns_fixture(tmp_path)
    for root in (tmp_path, ds):  # the checkout or its datasets/ folder
        data = layouts.dns_layout(root)
        speech = data.train["speech"] + data.valid["speech"]
        assert len(speech) == 6 and len(data.train["noise"]) + len(data.valid["noise"]) == 3
        assert {it.group for it in speech} == {f"reader {r}" for r in ("00001", "00002", "00003", "00004", "00005")}
        assert data.valid["speech"] and data.train["speech"]
        assert not {it.group for it in data.train["speech"]} & {it.group for it in data.valid["speech"]}
    pairs = layouts.dns_test_pairs(tmp_path)
    assert [p.name for p in pairs] == ["clnsp1_train_69005_1_snr15_tl-21_fileid_0.wav",
                                       "clnsp44_wind_97396_2_snr14_tl-26_fileid_3.wav",
                                       "clnsp52_amMeH4u6AO4_snr5_tl-18_fileid_12.wav"]
    assert [p.clean.name for p in pairs] == ["clean_fileid_0.wav", "clean_fileid_3.wav", "clean_fileid_12.wav"]
    # fileid_1 must not match fileid_12
    assert layouts.dns_test_pairs(ds)[2].clean.name == "clean_fileid_12.wav"


def test_dns_layout_errors(tmp_path):
    with pytest.raises(DataError, match="not found"):
        layouts.dns_layout(tmp_path / "missing")
    (tmp_path / "datasets" / "clean").mkdir(parents=True)
    with pytest.raises(DataError, match="noise"):
        layouts.dns_layout(tmp_path)
    (tmp_path / "datasets" / "noise").mkdir()
    with pytest.raises(DataError, match="no audio files"):
        layouts.dns_layout(tmp_path)
    with pytest.raises(DataError, match="no DNS synthetic test set"):
        layouts.dns_test_pairs(tmp_path)


def test_voicebank_layout_pairs_and_resampling(tmp_path):
    for i in (1, 2):
        x = speechlike(48000 * 2, 48000, seed=i)
        for folder, y in (("clean_testset_wav", x), ("noisy_testset_wav", x + 0.02 * np.random.default_rng(i).standard_normal(len(x)))):
            (tmp_path / folder).mkdir(exist_ok=True)
            sf.write(str(tmp_path / folder / f"p232_00{i}.wav"), y.astype(np.float32), 48000)
    pairs = layouts.voicebank_test_pairs(tmp_path)
    assert [(p.name, p.noisy.parent.name, p.clean.name) for p in pairs] == [
        ("p232_001.wav", "noisy_testset_wav", "p232_001.wav"), ("p232_002.wav", "noisy_testset_wav", "p232_002.wav")]
    y = read16k(pairs[0].clean)
    assert abs(len(y) - 32000) <= 1  # 2 s at 48 kHz -> 16 kHz
    ref = speechlike(32000, 16000, seed=1)  # the same signal synthesised at 16 kHz
    assert np.corrcoef(y[:32000], ref[: len(y)])[0, 1] > 0.8
    with pytest.raises(DataError, match="missing folder"):
        layouts.voicebank_test_pairs(tmp_path / "noisy_testset_wav")


def test_paired_folders_reports_unmatched(tmp_path):
    (tmp_path / "n").mkdir()
    (tmp_path / "c").mkdir()
    sf.write(str(tmp_path / "n" / "a.wav"), speechlike(1600), 16000)
    sf.write(str(tmp_path / "n" / "b.wav"), speechlike(1600), 16000)
    sf.write(str(tmp_path / "c" / "a.wav"), speechlike(1600), 16000)
    with pytest.raises(DataError, match="1 noisy file.*b.wav"):
        layouts.paired_folders(tmp_path / "n", tmp_path / "c")
    assert [p.clean for p in layouts.paired_folders(tmp_path / "n")] == [None, None]


def test_files_tsv_paths_resolve_from_the_data_root_and_its_split_column_is_used(tmp_path):
    """Like ../shared/data/speech/files.tsv: paths relative to the data root, a split column."""
    from training.data.layouts import manifest_layout
    from training.data.manifests import read_manifest

    root = tmp_path / "data"
    rows = ["split\tcategory\tpath\tseconds\tsample_rate\tgroup"]
    for split, spk in (("train", "11"), ("train", "12"), ("valid", "23")):
        rel = f"speech/libri/{spk}/a.wav"
        (root / rel).parent.mkdir(parents=True)
        sf.write(str(root / rel), speechlike(8000, seed=int(spk)), 16000)
        rows.append(f"{split}\tspeech\t{rel}\t0.5\t16000\tlibri {spk}")
    (root / "speech" / "files.tsv").write_text("\n".join(rows) + "\n")
    items = read_manifest(root / "speech" / "files.tsv")
    assert [Path(it.path) for it in items] == [root / "speech" / "libri" / s / "a.wav" for s in ("11", "12", "23")]
    noise = tmp_path / "noise.tsv"
    sf.write(str(tmp_path / "n.wav"), speechlike(8000, seed=9), 16000)
    sf.write(str(tmp_path / "m.wav"), speechlike(8000, seed=8), 16000)
    noise.write_text("path\tgroup\nn.wav\ta\nm.wav\tb\n")
    data = manifest_layout(str(root / "speech" / "files.tsv"), str(noise))
    assert [it.group for it in data.train["speech"]] == ["libri 11", "libri 12"]
    assert [it.group for it in data.valid["speech"]] == ["libri 23"]


def test_a_missing_file_is_reported_as_not_found(tmp_path):
    from training.data.audio_cache import AudioReadError, load_audio

    with pytest.raises(AudioReadError, match=f"^file not found: {tmp_path / 'gone.flac'}$"):
        load_audio(tmp_path / "gone.flac")


def test_data_without_manifests_points_at_materialize_and_the_quickstart(tmp_path, capsys):
    from training.cli import main

    (tmp_path / "speech").mkdir()
    (tmp_path / "speech" / "files.tsv").write_text("path\n")
    assert main(["fit", "--data", str(tmp_path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "has no manifests/ folder" in err and "materialize.sh" in err and "several GB" in err
    assert "quickstart in training/README.md" in err and f"--speech {tmp_path / 'speech' / 'files.tsv'}" in err
