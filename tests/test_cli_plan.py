"""``fdfleet plan``: through the real entry (subprocess) and in-process ``main``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fastdeploy_paddlefleet.cli import main

LAYER_KEYS = {
    "index",
    "kind",
    "num_q_heads",
    "num_kv_heads",
    "qk_head_dim",
    "v_head_dim",
    "window_left",
    "sliding_kv_heads",
    "sink",
    "softmax_scale",
    "mla",
}


def fdfleet(*args):
    return subprocess.run(
        [sys.executable, "-m", "fastdeploy_paddlefleet.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def plan_json(capsys, *args):
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_gpt_oss_json_subprocess():
    r = fdfleet("plan", "gpt-oss-20b", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert set(d) == {"source", "convention", "layers", "kv_cache", "pools", "warnings"}
    # issue 18: the recycling split beside FastDeploy's accounting (gpt-oss: half the layers slide)
    assert d["pools"]["fastdeploy_max_requests"] < d["pools"]["max_requests"]
    assert d["source"] == "gpt-oss-20b" and d["convention"] == "hf" and d["warnings"] == []
    assert len(d["layers"]) == 24
    for x in d["layers"]:
        assert set(x) == LAYER_KEYS
        assert (x["num_q_heads"], x["num_kv_heads"], x["sink"], x["mla"]) == (64, 8, "learnable", None)
        if x["index"] % 2 == 0:
            assert (x["kind"], x["window_left"], x["sliding_kv_heads"]) == ("sliding", 127, [0, 8])
        else:
            assert (x["kind"], x["window_left"], x["sliding_kv_heads"]) == ("full", None, None)
    kv = d["kv_cache"]
    assert kv["bytes_per_token"] == 24 * 8 * 128 * 2 and kv["dtype"] == "bf16"


def test_deepseek_json(capsys):
    d = plan_json(capsys, "deepseek-v3")
    assert {(x["qk_head_dim"], x["v_head_dim"]) for x in d["layers"]} == {(192, 128)}
    assert d["layers"][0]["mla"] == {
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 1536,
    }


def test_tiny_table_covers_every_kind():
    r = fdfleet("plan", "tiny")
    assert r.returncode == 0, r.stderr
    rows = r.stdout.splitlines()
    kinds = {line.split()[1] for line in rows[2:5]}
    assert kinds == {"full", "sliding", "headwise"}
    assert "off-by-one" in r.stdout and "learnable" in r.stdout
    assert "KV cache" in r.stdout and "max requests" in r.stdout


def test_tp2_halves_heads_and_slices_sinks(capsys):
    one = plan_json(capsys, "gpt-oss-20b")
    for rank in (0, 1):
        two = plan_json(capsys, "gpt-oss-20b", "--tp", "2", "--tp-rank", str(rank))
        for a, b in zip(one["layers"], two["layers"], strict=True):
            assert (b["num_q_heads"], b["num_kv_heads"]) == (a["num_q_heads"] // 2, a["num_kv_heads"] // 2)
        assert two["kv_cache"]["tp_size"] == 2 and two["kv_cache"]["tp_rank"] == rank
        assert two["kv_cache"]["bytes_per_token"] * 2 == one["kv_cache"]["bytes_per_token"]
    assert main(["plan", "gpt-oss-20b", "--tp", "2", "--tp-rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "q heads (sinks)" in out and "32-63" in out  # rank 1 holds sinks of heads 32..63 (inclusive)


def test_budget_options(capsys):
    d = plan_json(
        capsys, "tiny", "--block-size", "16", "--dtype", "fp8", "--memory-gib", "0.5", "--context", "100"
    )
    kv = d["kv_cache"]
    assert (kv["block_size"], kv["dtype_bytes"], kv["memory_gib"], kv["context"]) == (16, 1, 0.5, 100)
    assert kv["blocks_per_request"] == 7


def test_config_path(tmp_path, capsys):
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "sliding_window": 32}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    d = plan_json(capsys, str(path))
    assert d["source"] == str(path) and [x["window_left"] for x in d["layers"]] == [31, 31]


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["plan", "no-such-model"], "no such preset"),
        (["plan", "tiny", "--tp", "3"], "tp_size=3"),
        (["plan", "tiny", "--dtype", "fp64"], "fp64"),
        (["plan", "tiny", "--tp-rank", "1"], "tp_rank"),
    ],
)
def test_errors_in_process(capsys, args, fragment):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("fdfleet: error:") and fragment in err and err.count("\n") == 1


def test_bad_config_subprocess(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "softmax_type": "weird"}
        )
    )
    for source in (str(path), "definitely-not-a-preset"):
        r = fdfleet("plan", source)
        assert r.returncode == 2
        assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1 and r.stdout == ""
