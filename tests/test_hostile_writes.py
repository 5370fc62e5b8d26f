"""All-or-nothing writes (issue 19, bullet 3): weights, model directories, benchmark outputs.

Every case asserts a named error and that nothing that existed before changed: parameters are
compared with copies taken before the call, files byte for byte, directories by listing (no
temporary sibling or empty directory left behind).
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import stat
import sys
from pathlib import Path

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

from fastdeploy_paddlefleet.minifleet import build_minifleet  # noqa: E402
from fastdeploy_paddlefleet.plan import plan_from_config  # noqa: E402
from fastdeploy_paddlefleet.serving import modeldir  # noqa: E402
from fastdeploy_paddlefleet.serving.model import PaddleFleetForCausalLM  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def snapshot_tree(root: Path) -> dict[str, str]:
    """``relative path -> sha256`` of every file under ``root`` (directories as ``'dir'``)."""
    out = {}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# ---- weights ---------------------------------------------------------------------------------


def wrapper_():
    model = build_minifleet("tiny", seed=1)
    return PaddleFleetForCausalLM.from_model(model, plan_from_config(model.config), backend="reference")


def params(wrapper) -> dict[str, np.ndarray]:
    return {k: v.numpy().copy() for k, v in wrapper.model.state_dict().items()}


def bumped(before: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every weight + 1: a valid checkpoint that differs from the model everywhere."""
    return {k: v + 1 for k, v in before.items()}


BAD_LAST = [
    ("shape", lambda sd, name: np.zeros([3, 3], "float32"), ValueError, "has shape \\[3, 3\\]"),
    ("unknown name", None, ValueError, "weight names are not in the model"),
    ("int into float", lambda sd, name: sd[name].astype("int32"), TypeError, "dtype int32.*float32"),
    ("strings", lambda sd, name: np.full(sd[name].shape, "a"), TypeError, "dtype <U1"),
]


@pytest.mark.parametrize(("case", "make", "exc", "match"), BAD_LAST, ids=[c[0] for c in BAD_LAST])
def test_a_bad_last_tensor_leaves_every_parameter_unchanged(case, make, exc, match):
    """The bad tensor comes last: the old loader had already overwritten every earlier parameter."""
    wrapper = wrapper_()
    before = params(wrapper)
    sd = bumped(before)
    last = list(sd)[-1]
    if make is None:
        sd["decoder.layers.0.nope.weight"] = np.zeros([1], "float32")
    else:
        sd[last] = make(sd, last)
    with pytest.raises(exc, match=match) as info:
        wrapper.set_state_dict(sd)
    assert "no parameter was changed" in str(info.value)
    after = params(wrapper)
    for k, v in before.items():
        np.testing.assert_array_equal(after[k], v, err_msg=f"{case}: {k} changed")


def test_bfloat16_bits_from_numpy_are_named_not_read_as_numbers():
    """``paddle_bf16_tensor.numpy()`` is uint16 bits: the old loader cast 16256 (1.0's bits) to 16256.0."""
    wrapper = wrapper_()
    before = params(wrapper)
    name = list(before)[0]
    bits = paddle.ones(before[name].shape, dtype="bfloat16").numpy()
    assert bits.dtype == np.uint16 and int(bits.flat[0]) == 16256
    with pytest.raises(TypeError, match=r"dtype uint16, .*bits as uint16: pass the tensor itself"):
        wrapper.set_state_dict({name: bits})
    np.testing.assert_array_equal(params(wrapper)[name], before[name])
    wrapper.set_state_dict({name: paddle.ones(before[name].shape, dtype="bfloat16")})  # the tensor: cast
    np.testing.assert_array_equal(params(wrapper)[name], np.ones_like(before[name]))


def test_a_valid_checkpoint_still_loads_every_tensor():
    wrapper = wrapper_()
    sd = bumped(params(wrapper))
    assert wrapper.set_state_dict({"model." + k: v for k, v in sd.items()}) == []
    after = params(wrapper)
    for k, v in sd.items():
        np.testing.assert_array_equal(after[k], v)


# ---- model directories -----------------------------------------------------------------------


@pytest.fixture
def occupied(tmp_path):
    """A directory holding a user's own config.json + model.safetensors (and a note)."""
    d = tmp_path / "mine"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama", "mine": true}\n')
    (d / "model.safetensors").write_bytes(os.urandom(4096))
    (d / "notes.txt").write_text("keep me\n")
    return d


def siblings(d: Path) -> list[str]:
    return sorted(p.name for p in d.parent.iterdir() if p.name != d.name)


def test_non_empty_target_is_refused_without_force(occupied):
    before, around = snapshot_tree(occupied), siblings(occupied)
    with pytest.raises(ValueError, match=r"'.*mine' is not empty .*config.json.*--force"):
        modeldir.write_model_dir("tiny", occupied)
    assert modeldir.main(["tiny", str(occupied)]) == 2
    assert snapshot_tree(occupied) == before and siblings(occupied) == around


def test_empty_path_is_refused_and_the_working_directory_untouched(occupied, monkeypatch, capsys):
    """``... modeldir tiny ''`` wrote config.json and model.safetensors into the working directory."""
    monkeypatch.chdir(occupied)
    before = snapshot_tree(occupied)
    with pytest.raises(ValueError, match="must name a directory, got ''"):
        modeldir.write_model_dir("tiny", "")
    assert modeldir.main(["tiny", ""]) == 2
    assert "got ''" in capsys.readouterr().err
    assert modeldir.main(["tiny", "."]) == 2  # the working directory itself: not empty
    assert snapshot_tree(occupied) == before


def test_a_file_as_target_is_refused(tmp_path):
    f = tmp_path / "model"
    f.write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        modeldir.write_model_dir("tiny", f)
    assert f.read_text() == "x"


def _full_disk(written: list[str]):
    def save_file(tensors, path, *a, **kw):
        with open(path, "wb") as fh:  # half a file, then the disk is full
            fh.write(b"\0" * 1000)
        written.append(path)
        raise OSError(errno.ENOSPC, "No space left on device")

    return save_file


def test_disk_full_with_force_leaves_the_old_directory_byte_identical(occupied, monkeypatch):
    before, around = snapshot_tree(occupied), siblings(occupied)
    written: list[str] = []
    monkeypatch.setattr("safetensors.numpy.save_file", _full_disk(written))
    with pytest.raises(OSError, match=r"writing '.*mine' failed \(No space left on device\)") as info:
        modeldir.write_model_dir("tiny", occupied, force=True)
    assert info.value.errno == errno.ENOSPC
    assert written and not Path(written[0]).exists()  # the partial file was in a temporary sibling
    assert snapshot_tree(occupied) == before and siblings(occupied) == around


def test_disk_full_on_a_fresh_path_leaves_no_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("safetensors.numpy.save_file", _full_disk([]))
    target = tmp_path / "new" / "deeper" / "tiny"
    assert modeldir.main(["tiny", str(target)]) == 74  # EX_IOERR: a failed write (issue 30 item 5)
    err = capsys.readouterr().err
    assert str(target) in err and "No space left on device" in err
    assert list(tmp_path.iterdir()) == []  # neither the target nor the parents created for it


def test_ctrl_c_exits_130_with_one_line_and_changes_nothing(occupied, monkeypatch, capsys):
    before, around = snapshot_tree(occupied), siblings(occupied)

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr("safetensors.numpy.save_file", interrupted)
    assert modeldir.main(["tiny", str(occupied), "--force"]) == 130
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "interrupted" in err and "mine" in err
    assert snapshot_tree(occupied) == before and siblings(occupied) == around


@pytest.fixture
def strict_umask():
    """A umask of 077: files come out 0644 because the writer sets it, not because the umask allows it."""
    old = os.umask(0o077)
    yield
    os.umask(old)


def test_force_replaces_only_once_complete_and_files_are_0644(occupied, capsys, strict_umask):
    around = siblings(occupied)
    others = {p.name: p.read_bytes() for p in occupied.iterdir() if p.name not in modeldir.OURS}
    assert modeldir.main(["tiny", str(occupied), "--force", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["files"] == ["config.json", "model.safetensors"]
    # the user's other files stay, byte for byte (issue 30: --force replaces only the writer's own files)
    assert report["kept"] == sorted(others) and others
    assert {n: (occupied / n).read_bytes() for n in others} == others
    assert json.loads((occupied / "config.json").read_text())["model_type"] == "minifleet"
    for name in report["files"]:
        assert stat.S_IMODE((occupied / name).stat().st_mode) == 0o644, name
    assert siblings(occupied) == around  # no .tmp- or .old- directory left


def test_a_fresh_directory_gets_0644_files(tmp_path, strict_umask):
    out = modeldir.write_model_dir("tiny", tmp_path / "a" / "tiny", seed=2)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in out.iterdir())
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny"]
    # an existing empty directory (from mkdtemp, or the working directory) is filled in place: the
    # directory itself stays (a shell sitting in it keeps a valid working directory)
    empty = tmp_path / "empty"
    empty.mkdir()
    inode = empty.stat().st_ino
    assert modeldir.main(["tiny", str(empty)]) == 0
    assert empty.stat().st_ino == inode
    assert sorted(p.name for p in empty.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "empty"]  # no temporary sibling left


# ---- benchmark outputs (benchmarks/headwise_sim.py) ------------------------------------------


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location("headwise_sim", ROOT / "benchmarks" / "headwise_sim.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["headwise_sim"] = mod  # dataclasses look the module up
    spec.loader.exec_module(mod)
    return mod


COMMITTED = ROOT / "benchmarks" / "results"


def test_out_with_the_wrong_extension_is_refused(sim, tmp_path, capsys):
    """``--out results.png`` replaced a user's PNG with JSON."""
    png = tmp_path / "results.png"
    png.write_bytes(b"\x89PNG user's picture")
    before = snapshot_tree(tmp_path)
    assert sim.main(["--quick", "--out", str(png)]) == 2
    assert "--out" in capsys.readouterr().err
    assert sim.main(["--quick", "--out", str(tmp_path / "x.json"), "--plot", str(tmp_path / "x.json")]) == 2
    assert "--plot" in capsys.readouterr().err
    assert snapshot_tree(tmp_path) == before


def test_a_smoke_run_never_writes_the_committed_results(sim, capsys):
    before = snapshot_tree(COMMITTED)
    for flag in ("--quick", "--smoke"):
        assert sim.main([flag, "--out", str(COMMITTED / "headwise_sim.json")]) == 2
        assert "committed results" in capsys.readouterr().err
        assert sim.main([flag, "--out", "x.json", "--plot", str(COMMITTED / "headwise_sim.png")]) == 2
    assert snapshot_tree(COMMITTED) == before


def test_without_out_a_run_writes_a_temporary_directory(sim, monkeypatch, tmp_path, caplog):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    before = snapshot_tree(COMMITTED)
    caplog.set_level("INFO")
    assert sim.main(["--quick"]) == 0
    assert snapshot_tree(COMMITTED) == before
    (made,) = tmp_path.iterdir()
    assert sorted(p.name for p in made.iterdir()) == ["headwise_sim.json", "headwise_sim.png"]
    assert json.loads((made / "headwise_sim.json").read_text())["quick"] is True
    assert str(made / "headwise_sim.json") in caplog.text


def test_a_failed_plot_leaves_both_previous_files(sim, monkeypatch, tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    out.write_text('{"fdfleet-benchmark": "headwise_sim", "old": true}\n')  # its own earlier output
    png.write_bytes(b"old plot")
    before = snapshot_tree(tmp_path)
    monkeypatch.setattr(sim, "run", lambda args: {"runs": [], "quick": True})

    def full_disk(results, path):
        Path(path).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sim, "plot", full_disk)
    assert sim.main(["--quick", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert str(out) in err and "No space left on device" in err and "left as they were" in err
    assert snapshot_tree(tmp_path) == before  # no temporary sibling either


# ---- writes that never delete what they did not make (issue 30, item 3) -----------------------


def test_a_target_that_fills_up_during_the_write_is_refused_and_kept(tmp_path, monkeypatch):
    """``modeldir`` checked the target only at the start: a file saved into it during the write was
    deleted when the finished directory was swapped in (exit 0). Now the swap refuses and touches
    nothing of the user's."""
    target = tmp_path / "tiny"
    target.mkdir()
    real = modeldir._write_files

    def write_then_user_saves(tmp, config, tensors):
        real(tmp, config, tensors)
        (target / "draft.txt").write_text("the user's file\n")  # saved while the weights were written

    monkeypatch.setattr(modeldir, "_write_files", write_then_user_saves)
    with pytest.raises(ValueError, match=r"filled up during the write; nothing was written"):
        modeldir.write_model_dir("tiny", target)
    assert sorted(p.name for p in target.iterdir()) == ["draft.txt"]
    assert (target / "draft.txt").read_text() == "the user's file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # no temporary sibling left


def test_a_name_taken_mid_move_takes_back_only_what_was_moved(tmp_path, monkeypatch):
    target = tmp_path / "tiny"
    target.mkdir()
    real = modeldir._place_new
    calls = []

    def place(src, dst):
        if calls:  # the user's model.safetensors appears between the two moves
            (target / "model.safetensors").write_bytes(b"mine")
        calls.append(dst.name)
        real(src, dst)

    monkeypatch.setattr(modeldir, "_place_new", place)
    with pytest.raises(ValueError, match="filled up during the write"):
        modeldir.write_model_dir("tiny", target)
    assert sorted(p.name for p in target.iterdir()) == ["model.safetensors"]
    assert (target / "model.safetensors").read_bytes() == b"mine"


def test_force_refuses_the_working_directory_home_and_root(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("x")
    monkeypatch.chdir(work)
    before = snapshot_tree(work)
    with pytest.raises(ValueError, match="the current directory: --force refuses it"):
        modeldir.write_model_dir("tiny", ".", force=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(work))  # Path.home() reads HOME
    with pytest.raises(ValueError, match="the home directory: --force refuses it"):
        modeldir.write_model_dir("tiny", str(work), force=True)
    with pytest.raises(ValueError, match="filesystem root: --force refuses it"):
        modeldir.write_model_dir("tiny", "/", force=True)
    assert snapshot_tree(work) == before


def test_a_symlink_target_is_written_through(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    out = modeldir.write_model_dir("tiny", link)
    assert link.is_symlink() and os.readlink(link) == str(real)  # the link stays a link
    assert out == real.resolve()
    assert sorted(p.name for p in real.iterdir()) == ["config.json", "model.safetensors"]
    # --force through the link: the files are replaced in the real directory, the link kept
    (real / "notes.txt").write_text("keep")
    modeldir.write_model_dir("tiny", link, force=True, seed=3)
    assert link.is_symlink() and (real / "notes.txt").read_text() == "keep"
    assert json.loads((real / "config.json").read_text())["seed"] == 3


def test_a_safetensors_error_with_force_is_named_exit_74_and_changes_nothing(occupied, monkeypatch, capsys):
    """``fdfleet modeldir ... --force`` on a full disk: safetensors raises its own ``SafetensorError``
    (no OSError), which ended in a traceback (issue 30 item 5): a named error, exit 74, the target and
    its siblings byte for byte as before, no temporary directory left."""
    from safetensors import SafetensorError

    before, around = snapshot_tree(occupied), siblings(occupied)

    def full(tensors, path, *a, **kw):
        Path(path).write_bytes(b"\0" * 100)  # half a file in the temporary sibling
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr("safetensors.numpy.save_file", full)
    with pytest.raises(modeldir.ModelDirWriteError, match=r"writing '.*mine' failed \(.*StorageFull") as info:
        modeldir.write_model_dir("tiny", occupied, force=True)
    assert isinstance(info.value, OSError) and "left as it was" in str(info.value)
    assert snapshot_tree(occupied) == before and siblings(occupied) == around
    capsys.readouterr()
    from fastdeploy_paddlefleet.cli import main

    assert main(["modeldir", "tiny", str(occupied), "--force"]) == 74
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "mine" in lines[0] and "StorageFull" in lines[0] and lines[0].startswith("fdfleet: error:")
    assert snapshot_tree(occupied) == before and siblings(occupied) == around


def test_an_oserror_during_the_swap_is_named_exit_74(occupied, monkeypatch, capsys):
    """A rename that fails half-way (EIO) while --force swaps the files in: exit 74, nothing changed."""
    before, around = snapshot_tree(occupied), siblings(occupied)
    real_rename = Path.rename
    calls = []

    def flaky(self, target):
        calls.append(self)
        if len(calls) == 3:  # after the first file was set aside and placed
            raise OSError(errno.EIO, "Input/output error")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", flaky)
    assert modeldir.main(["tiny", str(occupied), "--force"]) == 74
    err = capsys.readouterr().err
    assert "Input/output error" in err and len(err.strip().splitlines()) == 1, err
    monkeypatch.setattr(Path, "rename", real_rename)
    assert snapshot_tree(occupied) == before and siblings(occupied) == around
