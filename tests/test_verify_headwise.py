"""``fdfleet verify --headwise-kv`` / ``FDFLEET_HEADWISE_KV``: KV pages from the head-wise manager with
sliding-window recycling, released pages NaN-filled at once; and ``--config`` with a PaddleFleet config.

The reference is the host model's own attention (dense, no cache, whole sequence), as in every
verify run; the number of released pages is checked against the window rule written out here.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

from fastdeploy_paddlefleet.cli import main  # noqa: E402
from fastdeploy_paddlefleet.cli import verify as verify_cli  # noqa: E402
from fastdeploy_paddlefleet.kvcache import headwise as headwise_mod  # noqa: E402
from fastdeploy_paddlefleet.kvcache.headwise import HeadwiseKVManager  # noqa: E402
from fastdeploy_paddlefleet.minifleet import build_minifleet  # noqa: E402
from fastdeploy_paddlefleet.plan import plan_from_config  # noqa: E402
from fastdeploy_paddlefleet.runner import fleet_case  # noqa: E402
from fastdeploy_paddlefleet.runner import verify as driver  # noqa: E402
from fastdeploy_paddlefleet.runner.batch import allocate_kv_caches  # noqa: E402
from fastdeploy_paddlefleet.runner.headwise_state import HeadwiseKVState  # noqa: E402

TOL = 1e-4
BLOCK = 4  # fdfleet verify's default block size


@pytest.fixture(autouse=True)
def _no_env_switch(monkeypatch):
    monkeypatch.delenv("FDFLEET_HEADWISE_KV", raising=False)
    monkeypatch.setenv("FDFLEET_BACKEND", "reference")


def verify_json(capsys, *args):
    code = main(["verify", "--json", *args])
    out = capsys.readouterr().out
    return code, json.loads(out)


def expected_released(plan, final_lens, block_size=BLOCK) -> int:
    """The window rule, per page pool: layers with the same kv heads and per-head windows share page
    ids; a sliding kv head with ``window_left = W`` of a request with ``L`` tokens computed has released
    every block ``k`` with ``(k + 1) * bs <= L - W``."""
    layouts = {tuple(layer.head_window(h) for h in range(layer.num_kv_heads)) for layer in plan}
    return sum(
        max(0, n - w) // block_size
        for windows in layouts
        for w in windows
        if w is not None
        for n in final_lens
    )


@pytest.mark.parametrize("preset", ["tiny", "tiny-mla"])
def test_headwise_kv_flag_releases_pages_and_keeps_parity(capsys, preset):
    code, report = verify_json(capsys, "--preset", preset, "--headwise-kv")
    assert code == 0 and report["passed"] is True
    assert report["headwise_kv"] is True
    assert report["max_abs_logit_diff"] <= TOL and report["greedy_agreement"] == 1.0
    plan = plan_from_config(build_minifleet(preset).config)
    final = [r["prompt_len"] + 8 for r in report["requests"]]  # 8 decode steps (default)
    expected = expected_released(plan, final)
    assert report["pages_released"] == expected
    per_step = report["per_step"]
    assert sum(s["pages_released"] for s in per_step) == report["pages_released"]
    if preset == "tiny-mla":  # PaddleFleet's MLA layers never slide: nothing to release, parity still holds
        assert expected == 0
    else:  # pages come back while requests still decode, not only when they finish
        assert expected > 0 and any(s["pages_released"] and s["num_decode"] for s in per_step)
    assert 0 < report["max_pages_used"] <= report["pages_total"]


def test_headwise_kv_table_shows_pages(capsys):
    assert main(["verify", "--headwise-kv", "--steps", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "head-wise KV pages=" in out[0] and "freed" in out[1]
    assert "pages released by the window rule" in out[-2] and out[-1].startswith("PASSED")


def test_env_switch_turns_headwise_kv_on_and_the_flag_wins(capsys, monkeypatch):
    code, report = verify_json(capsys, "--steps", "2")
    assert code == 0 and report["headwise_kv"] is False and "pages_released" not in report
    assert all("pages_used" not in s for s in report["per_step"])  # default output unchanged
    monkeypatch.setenv("FDFLEET_HEADWISE_KV", "1")
    code, report = verify_json(capsys, "--steps", "2")
    assert code == 0 and report["headwise_kv"] is True and report["pages_released"] > 0
    code, report = verify_json(capsys, "--steps", "2", "--no-headwise-kv")
    assert code == 0 and report["headwise_kv"] is False


def test_bad_env_value_is_a_one_line_error(capsys, monkeypatch):
    monkeypatch.setenv("FDFLEET_HEADWISE_KV", "maybe")
    assert main(["verify", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("fdfleet: error:") and "FDFLEET_HEADWISE_KV" in err and "maybe" in err


def _release_one_block_early(monkeypatch) -> None:
    """A broken manager: sliding heads give back one block that is still inside their window."""

    def early(self, computed, block_size):
        if self.window is None:
            return 0
        return max(0, computed - self.window + block_size) // block_size

    monkeypatch.setattr(headwise_mod._Lane, "release_target", early)
    monkeypatch.setattr(headwise_mod._Lane, "next_release_at", lambda self, block_size: 0)


def _keep_released_in_tables(monkeypatch) -> None:
    """A broken manager: released pages stay in the page tables handed to the backends (the pool has
    them back: NaN-filled, or reused by another head)."""
    original = HeadwiseKVManager.tables
    seen: dict = {}

    def tables(self, req_ids, max_pages=None):
        out = {}
        for li, table in original(self, req_ids, max_pages).items():
            table = table.copy()
            hkv = table.shape[0] // len(req_ids)
            for b, rid in enumerate(req_ids):
                rows = table[b * hkv : (b + 1) * hkv]
                old = seen.get((li, rid))
                if old is not None:
                    rows = np.where(rows >= 0, rows, old)
                seen[(li, rid)] = rows
                table[b * hkv : (b + 1) * hkv] = rows
            out[li] = table
        return out

    monkeypatch.setattr(HeadwiseKVManager, "tables", tables)


def test_negative_control_reading_a_released_page_fails(capsys, monkeypatch):
    """Pages released while still inside the window, yet still in the tables: the pool hands them out
    again, so one page sits in two places of the tables; the backends' metadata checks refuse the step
    by name (before any read of a NaN-filled or overwritten page could go unnoticed)."""
    _release_one_block_early(monkeypatch)
    _keep_released_in_tables(monkeypatch)
    assert main(["verify", "--headwise-kv", "--json"]) == 2
    err = capsys.readouterr().err.strip()
    assert "block_tables_headwise" in err and "page" in err and len(err.splitlines()) == 1, err
    code, report = verify_json(capsys)  # the same manager unused: passes
    assert code == 0


def test_negative_control_releasing_inside_the_window_is_refused(monkeypatch):
    """A manager releasing one block early that marks it -1: the backend refuses the table."""
    _release_one_block_early(monkeypatch)
    case = fleet_case.build_minifleet_case("tiny", "reference")
    with pytest.raises(ValueError, match="block_tables_headwise"):
        driver.run_verify(case, progress=False, headwise_kv=True)


def test_headwise_state_poisons_exactly_the_released_pages():
    plan = plan_from_config(build_minifleet("tiny").config)
    caches = allocate_kv_caches(plan, 16, BLOCK)  # zeros
    state = HeadwiseKVState(plan, 16, BLOCK, 8, caches=caches)
    state.schedule([("a", 20)])
    assert state.recycle(["a"]) == expected_released(plan, [20]) == 9  # (20 - 7) // 4 = 3 blocks x 3 heads
    tables = state.manager.tables(["a"])
    for layer in plan:
        key, value = caches[layer.index]
        hkv = layer.num_kv_heads
        owned = {int(p) for p in tables[layer.index].reshape(-1) if p >= 0}
        for cache in (key, value):
            nan_pages = {
                b * hkv + h for b in range(16) for h in range(hkv) if np.isnan(cache[b, h].numpy()).all()
            }
            assert not nan_pages & owned
            expected = 0 if layer.kind == "full" else (6 if layer.kind == "sliding" else 3)
            assert len(nan_pages) == expected, (layer.index, layer.kind)
    state.release("a")
    assert state.pages_used == 0 and state.requests == []
    assert all(np.isnan(k.numpy()).any() for k, _ in caches)


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ([("a", 1), ("a", 1)], "repeat a request id"),
        ([("a", -1)], "must be an int >= 0"),
        ([("a", 40)], "max_blocks_per_seq"),
    ],
)
def test_headwise_state_bad_steps(steps, message):
    state = HeadwiseKVState(plan_from_config(build_minifleet("tiny").config), 16, BLOCK, 8)
    with pytest.raises(ValueError, match=message):
        state.schedule(steps)
    assert state.pages_used == 0
    with pytest.raises(ValueError, match="unknown request id"):
        state.release("zz")


def test_headwise_state_pool_exhausted_names_the_pages():
    state = HeadwiseKVState(plan_from_config(build_minifleet("tiny").config), 2, BLOCK, 8)
    with pytest.raises(ValueError, match="pool exhausted"):
        state.schedule([("a", 12)])


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None
    or importlib.util.find_spec("fastdeploy_paddlefleet.backends.triton") is None,
    reason="triton backend not available",
)
def test_headwise_kv_triton_backend_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "FDFLEET_HEADWISE_KV": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "fastdeploy_paddlefleet.cli", "verify", "--json", "--backend", "triton"]
        + ["--steps", "3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["backend"] == "triton" and report["passed"] and report["headwise_kv"]
    assert report["max_abs_logit_diff"] <= TOL and report["greedy_agreement"] == 1.0
    assert report["pages_released"] > 0


# ---- the FastDeploy model class with head-wise tables ------------------------------------------
def test_model_forward_reads_headwise_tables(monkeypatch, caplog):
    from fastdeploy_paddlefleet.serving.model import PaddleFleetForCausalLM

    monkeypatch.setenv("FDFLEET_HEADWISE_KV", "1")
    native = build_minifleet("tiny", seed=3)
    model = PaddleFleetForCausalLM.from_model(
        build_minifleet("tiny", seed=3), plan_from_config(native.config), backend="reference"
    )
    assert model.headwise_kv is True
    caches = allocate_kv_caches(model.plan, 24, BLOCK, fill=float("nan"))
    state = HeadwiseKVState(model.plan, 24, BLOCK, 8, caches=caches)
    rng = np.random.default_rng(0)
    tokens = {"a": [], "b": []}
    for batch in ([("a", 9)], [("a", 8), ("b", 5)], *[[("a", 1), ("b", 1)]] * 6):
        meta = state.schedule(batch)
        new = {rid: [int(t) for t in rng.integers(0, 256, n)] for rid, n in batch}
        forward_meta = SimpleNamespace(**vars(meta), caches=[c for pair in caches for c in pair])
        ids = paddle.to_tensor([t for rid, _ in batch for t in new[rid]], dtype="int64")
        logits = model.compute_logits(model({"ids_remove_padding": ids}, forward_meta)).numpy()
        state.recycle([rid for rid, _ in batch])
        row = 0
        for rid, n in batch:
            tokens[rid] += new[rid]
            with paddle.no_grad():
                ref = native(paddle.to_tensor([tokens[rid]], dtype="int64"))[0, -n:].numpy()
            assert np.abs(logits[row : row + n] - ref).max() <= TOL
            row += n
    assert state.pages_released > 0
    # no head-wise tables from the host while the switch is on: one warning, still correct
    meta = state.schedule([("a", 1)])
    forward_meta = SimpleNamespace(**{**vars(meta), "block_tables_headwise": None}, caches=[])
    with caplog.at_level(logging.WARNING, logger="fastdeploy_paddlefleet.serving.model"):
        _warn_only(model, forward_meta)
        _warn_only(model, forward_meta)
    assert sum("FDFLEET_HEADWISE_KV is on" in r.message for r in caplog.records) == 1


def _warn_only(model, forward_meta) -> None:
    """Run the forward's metadata handling up to the caches (which are empty here, so it stops)."""
    with pytest.raises(ValueError, match="caches"):
        model({"ids_remove_padding": paddle.to_tensor([1], dtype="int64")}, forward_meta)


def test_model_bad_env_value_fails_at_build(monkeypatch):
    from fastdeploy_paddlefleet.serving.model import PaddleFleetForCausalLM

    monkeypatch.setenv("FDFLEET_HEADWISE_KV", "maybe")
    model = build_minifleet("tiny")
    with pytest.raises(ValueError, match="FDFLEET_HEADWISE_KV='maybe'"):
        PaddleFleetForCausalLM.from_model(model, plan_from_config(model.config), backend="reference")


# ---- --config with a PaddleFleet model config ----------------------------------------------------
QWEN3 = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.fixture
def fake_paddlefleet(monkeypatch):
    """``paddlefleet`` "installed", PaddleFormers' builder replaced by minifleet tiny models: each build
    has different random weights (seeds 1, 2, ...), so parity needs the state-dict copy."""
    built = []

    def build(config, seed):
        built.append(config)
        return build_minifleet("tiny", seed=seed + len(built))

    monkeypatch.setattr(verify_cli, "_paddlefleet_installed", lambda: True)
    monkeypatch.setattr(fleet_case, "build_paddlefleet_model", build)
    return built


def test_paddlefleet_config_builds_twins_patches_one_and_verifies(capsys, tmp_path, fake_paddlefleet):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3))
    code, report = verify_json(capsys, "--config", str(path), "--steps", "3", "--headwise-kv")
    assert code == 0 and report["passed"], report["max_abs_logit_diff"]
    assert report["name"] == "paddlefleet:qwen3" and report["extras"]["host"] == "paddlefleet"
    # the plan is the built model's own (tiny: 5 layers, sliding and head-wise ones), not the qwen3 file's
    assert report["layers_patched"] == 5 and report["pages_released"] > 0
    assert len(fake_paddlefleet) == 2
    assert all(type(c).__name__ == "Qwen3Config" and c.num_hidden_layers == 5 for c in fake_paddlefleet)


def test_paddlefleet_twins_differ_without_the_state_dict_copy(tmp_path, fake_paddlefleet):
    """The fake builds differ, so the copy in build_paddlefleet_case is what makes them agree."""
    a = fleet_case.build_paddlefleet_model(None, 0)
    b = fleet_case.build_paddlefleet_model(None, 0)
    assert any(
        not np.array_equal(a.state_dict()[k].numpy(), b.state_dict()[k].numpy()) for k in a.state_dict()
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"model_type": "no_such_arch"}, "model_type='no_such_arch'"),
        ({"architectures": []}, "architectures"),
    ],
)
def test_paddlefleet_config_bad_fields_exit_2(capsys, tmp_path, fake_paddlefleet, fields, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**QWEN3, **fields}))
    assert main(["verify", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fdfleet: error:") and message in err
    assert not fake_paddlefleet  # refused before building anything


@pytest.mark.skipif(importlib.util.find_spec("paddleformers") is None, reason="paddleformers not installed")
def test_headwise_kv_on_a_paddleformers_model(capsys):
    code, report = verify_json(capsys, "--paddleformers", "gpt_oss", "--headwise-kv", "--steps", "4")
    assert code == 0 and report["passed"] and report["headwise_kv"]
    assert report["pages_released"] > 0  # gpt_oss: sliding layers (window 8) next to full ones
