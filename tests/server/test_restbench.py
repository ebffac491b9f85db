"""The REST throughput tool against a real server process: every request is checked and timed."""
from __future__ import annotations

import json

import numpy as np
import soundfile as sf


def test_restbench_times_each_request_of_a_running_server(model_path, tmp_path, capsys):
    from tools import restbench
    from tools.launch import start

    rate = 16000
    audio = (0.1 * np.sin(2 * np.pi * 220 * np.arange(rate // 2) / rate)).astype("float32")
    path = tmp_path / "half-second.wav"
    sf.write(path, audio, rate)
    srv = start(model_path, device="cpu", workers=1, threads=1, max_streams=1, capacity=1)
    try:
        rc = restbench.main(["--url", srv.base, "--server-pid", str(srv.pid), "--file", str(path),
                             "--seconds", "1.5", "--repeat", "2", "--json"])
    finally:
        srv.stop()
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["seconds"] == 1.5 and result["sample_rate"] == rate  # the file repeated to the length asked for
    assert len(result["requests"]) == 2
    for r in result["requests"]:
        assert r["wall_s"] > 0 and r["server_cpu_s"] > 0  # the server process did the work


def test_restbench_wav_is_the_repeated_audio():
    import io

    from tools.restbench import wav_bytes

    x = np.array([0, 1000, -1000, 32767], dtype="<i2")
    y, rate = sf.read(io.BytesIO(wav_bytes(np.resize(x, 10), 8000)), dtype="int16")
    assert rate == 8000 and y.tolist() == np.resize(x, 10).tolist()
