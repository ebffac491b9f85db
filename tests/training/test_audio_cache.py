"""The 16 kHz cache: decode once, resample, mono, and unreadable files reported and skipped."""
from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf

from tests.conftest import speechlike
from tests.tolerance import assert_close_to_peak, snr_db
from training.data.audio_cache import cached_audio, load_audio
from training.data.manifests import DataError, Item


def _write(path, x, sr):
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(path), x, sr)
    return Item(str(path), len(x) / sr, sr, "g")


def test_cache_resamples_downmixes_and_reuses(tmp_path):
    x44 = speechlike(44100, 44100, seed=1)
    items = [_write(tmp_path / "a.flac", np.stack([x44, x44], axis=1), 44100),
             _write(tmp_path / "b.wav", speechlike(8000, 16000, seed=2), 16000)]
    logs = []
    s = cached_audio(items, "speech_train", tmp_path / "cache", jobs=1, log=logs.append)
    assert len(s) == 2 and abs(len(s.clip(0)) - 16000) <= 1 and len(s.clip(1)) == 8000
    assert_close_to_peak(s.clip(1), sf.read(str(tmp_path / "b.wav"), dtype="float32")[0])
    assert any("decoding 2 files" in m for m in logs)
    logs.clear()
    again = cached_audio(items, "speech_train", tmp_path / "cache", jobs=1, log=logs.append)
    assert not any("decoding" in m for m in logs) and again.folder == s.folder  # built once
    np.testing.assert_array_equal(again.clip(0), s.clip(0))


def test_corrupt_files_are_reported_with_path_and_skipped(tmp_path):
    good = _write(tmp_path / "good.wav", speechlike(8000, seed=3), 16000)
    corrupt = tmp_path / "corrupt.wav"
    corrupt.write_bytes(b"RIFF\x24\x00\x00\x00WAVEfmt garbage that is not audio")
    empty = tmp_path / "empty.flac"
    empty.write_bytes(b"")
    silent = _write(tmp_path / "silent.wav", np.zeros(4000, np.float32), 16000)
    items = [good, Item(str(corrupt), group="g"), Item(str(empty), group="g"), Item(str(tmp_path / "missing.wav"), group="g"), silent]
    logs = []
    s = cached_audio(items, "speech_train", tmp_path / "cache", jobs=2, log=logs.append)
    assert len(s) == 1 and s.items[0].path == good.path
    assert len(s.skipped) == 4
    text = "\n".join(logs)
    assert "skipped 4 unreadable file(s) of 5" in text
    for p in ("corrupt.wav", "empty.flac", "missing.wav", "silent.wav"):
        assert str(tmp_path / p) in text
    assert "digital silence" in text


def test_no_readable_file_is_an_error(tmp_path):
    bad = tmp_path / "bad.ogg"
    bad.write_bytes(b"OggS not really")
    with pytest.raises(DataError, match="none of the 1 files could be read"):
        cached_audio([Item(str(bad))], "noise_train", tmp_path / "cache", jobs=1, log=lambda *_: None)
    with pytest.raises(DataError, match="no files"):
        cached_audio([], "noise_train", tmp_path / "cache")


def test_load_audio_rejects_nan(tmp_path):
    x = speechlike(1600, seed=1)
    x[10] = np.nan
    sf.write(str(tmp_path / "nan.wav"), x, 16000, subtype="FLOAT")
    with pytest.raises(Exception, match="NaN"):
        load_audio(tmp_path / "nan.wav")


def test_mp3_is_decoded_aligned_downmixed_and_resampled(tmp_path):
    """Some real ambient recordings of the corpus are MP3 (training/corpus/extra.tsv.gz): the bundled
    libsndfile decodes them without the encoder's delay, so the 16 kHz clip lines up with the source."""
    import soxr

    x = speechlike(48000, 24000, seed=4)
    sf.write(str(tmp_path / "a.mp3"), np.stack([x, x], axis=1), 24000, format="MP3")
    y = load_audio(tmp_path / "a.mp3")
    ref = soxr.resample(x, 24000, 16000)
    assert len(y) == len(ref)
    assert snr_db(ref, y) > 15  # a lossy codec, aligned: one sample of lag gives about 13 dB
