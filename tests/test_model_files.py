"""Only regular files are read from a model directory (issue 30, item 4).

A FIFO named ``*.safetensors`` made ``fdfleet verify --model DIR`` wait forever (opening a FIFO blocks
until a writer comes); a device can be endless. Every such file is refused by name before it is
opened: FIFOs, sockets and devices (also behind a symbolic link) as weights or as ``config.json``,
and a weights file whose safetensors header claims more bytes than the file holds. Each case runs
the real CLI in a child process under a timeout, so a hang fails the test instead of the suite.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("paddle", reason="fdfleet verify --model builds the model with Paddle")
pytest.importorskip("safetensors")

from fastdeploy_paddlefleet.plan.fields import read_json_file, regular_file_size  # noqa: E402
from fastdeploy_paddlefleet.runner.checkpoint_case import checkpoint_files  # noqa: E402

CLI = [sys.executable, "-m", "fastdeploy_paddlefleet.cli"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from fastdeploy_paddlefleet.serving.modeldir import write_model_dir

    return Path(write_model_dir("tiny", tmp_path_factory.mktemp("files") / "tiny", dtype="float32", seed=0))


def _copy(model_dir: Path, dest: Path) -> Path:
    dest.mkdir()
    for f in model_dir.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    return dest


def _verify(d: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FDFLEET_")}
    return subprocess.run(
        [*CLI, "verify", "--model", str(d), "--json"], capture_output=True, text=True, timeout=120, env=env
    )


def test_a_fifo_named_safetensors_is_refused_not_waited_on(model_dir, tmp_path):
    d = _copy(model_dir, tmp_path / "m")
    os.mkfifo(d / "extra.safetensors")
    proc = _verify(d)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "extra.safetensors" in proc.stderr and "FIFO" in proc.stderr


def test_a_socket_and_a_device_are_refused(model_dir, tmp_path):
    d = _copy(model_dir, tmp_path / "m")
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(d / "shard.safetensors"))
        with pytest.raises(ValueError, match=r"shard\.safetensors' is a socket"):
            checkpoint_files(d)
    finally:
        sock.close()
    os.unlink(d / "shard.safetensors")
    os.symlink("/dev/zero", d / "zero.safetensors")  # a device behind a link
    with pytest.raises(ValueError, match=r"zero\.safetensors' is a device"):
        checkpoint_files(d)
    proc = _verify(d)
    assert proc.returncode == 2 and "zero.safetensors" in proc.stderr, proc.stderr[-2000:]


def test_a_config_json_that_is_not_a_regular_file(tmp_path):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"config\.json' is a FIFO"):
        read_json_file(fifo)
    with pytest.raises(ValueError, match=r"is a directory"):
        read_json_file(tmp_path)
    with pytest.raises(ValueError, match=r"cannot read"):
        regular_file_size(tmp_path / "absent.json", "config file")


def test_a_truncated_weights_file_is_named_before_it_is_read(model_dir, tmp_path):
    d = _copy(model_dir, tmp_path / "m")
    body = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (d / "cut.safetensors").write_bytes(struct.pack("<Q", len(body) + 4096) + body)  # header past the end
    (d / "tiny.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match=r"cut\.safetensors': not a readable safetensors file: its header"):
        checkpoint_files(d)
    (d / "cut.safetensors").unlink()
    with pytest.raises(ValueError, match=r"tiny\.safetensors': not a readable safetensors file: 2 bytes"):
        checkpoint_files(d)
