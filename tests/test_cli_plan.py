"""``fdfleet plan``: through the real entry (subprocess) and in-process ``main``."""

from __future__ import annotations

import json
import math
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
    assert set(d) == {
        "source",
        "convention",
        "layers",
        "kv_cache",
        "pools",
        "warnings",
        "recycle",
        "fastdeploy_flags",
    }
    # issue 18: the recycling pool beside FastDeploy's accounting (gpt-oss: half the layers slide)
    (row,) = d["pools"]["contexts"]
    assert row["context"] == 8192 and row["fastdeploy_requests"] < row["recycling_requests"]
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
        capsys, "tiny", "--block-size", "16", "--dtype", "fp16", "--memory-gib", "0.5", "--context", "100"
    )
    kv = d["kv_cache"]
    assert (kv["block_size"], kv["dtype_bytes"], kv["memory_gib"], kv["context"]) == (16, 2, 0.5, 100)
    assert kv["blocks_per_request"] == 7 and kv["kv_cache_quant"] is None


@pytest.mark.parametrize("dtype", ["fp8", "int8", "FP8", "float8_e4m3fn"])
def test_quantized_dtype_points_to_kv_cache_quant(capsys, dtype):
    """``--dtype fp8`` is a quantized cache, which FastDeploy selects with kv_cache_quant_type:
    refused, naming the flag that does it (an alias would have to guess the format)."""
    assert exit_code(["plan", "tiny", "--dtype", dtype]) == 2
    err = capsys.readouterr().err
    assert "--dtype" in err and "--kv-cache-quant block_wise_fp8" in err and repr(dtype) in err


@pytest.mark.parametrize(
    "value,fragment",
    [("int8_zp", "zero-point"), ("float8_e4m3", "240"), ("int4_zp", "int4"), ("fp4", "unknown")],
)
def test_kv_cache_quant_refused_by_name(capsys, value, fragment):
    assert exit_code(["plan", "tiny", "--kv-cache-quant", value]) == 2
    err = capsys.readouterr().err
    assert "--kv-cache-quant" in err and repr(value) in err and fragment in err


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


# ---- the recycling report: one pool, a mix of request lengths ----------------------------------------
#
# The references below are computed by hand from the plan's own layer fields (``--json``'s
# "layers"), never with kvcache/pools.py: FastDeploy prices a block at every layer's shape and a
# request holds ceil((ctx + 2 * bs + 12) / bs) blocks of every layer (its decode look-ahead).

GIB = 1 << 30
CONTEXTS = (128, 256, 1024, 2048, 4096, 8192, 32768)
SLIDING_PRESETS = ("gpt-oss-20b", "gemma3-27b", "mimo-v2-flash-like", "ernie-4.5-21b-a3b-headwise")


def fd_blocks_per_request(ctx, bs=64):
    return math.ceil((ctx + 2 * bs + 12) / bs)


def fd_reference(layers, ctx, memory_gib=40, bs=64, dtype_bytes=2):
    """FastDeploy's max concurrent requests of ``ctx`` tokens, by hand."""
    price = bs * sum(x["num_kv_heads"] * (x["qk_head_dim"] + x["v_head_dim"]) for x in layers) * dtype_bytes
    return int(memory_gib * GIB) // price // fd_blocks_per_request(ctx, bs)


def exit_code(argv):
    """``main``'s exit code, argparse's own exits (a bad flag value) included."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def ctx_arg(contexts):
    return ",".join(str(c) for c in contexts)


@pytest.mark.parametrize("preset", SLIDING_PRESETS)
def test_recycling_never_serves_fewer_than_fastdeploy(capsys, preset):
    d = plan_json(capsys, preset, "--context", ctx_arg(CONTEXTS))
    pools = d["pools"]
    assert pools["max_model_len"] == max(CONTEXTS) and pools["layout"]["padding"] == 0.0
    rows = pools["contexts"]
    assert [r["context"] for r in rows] == list(CONTEXTS)  # one row each, in the order given
    for r in rows:
        ctx = r["context"]
        assert r["fastdeploy_requests"] == fd_reference(d["layers"], ctx), ctx
        assert r["fastdeploy_blocks_per_request"] == fd_blocks_per_request(ctx)
        assert r["recycling_requests"] >= r["fastdeploy_requests"] >= 1, (ctx, r)
        assert r["pages_per_request"] <= r["fastdeploy_pages_per_request"]
        assert r["ratio"] == pytest.approx(r["recycling_requests"] / r["fastdeploy_requests"])
    # sliding windows pay off once a request outgrows them
    assert rows[-1]["recycling_requests"] > rows[-1]["fastdeploy_requests"]
    # the per-layer budget tables use the longest context
    assert d["kv_cache"]["context"] == max(CONTEXTS)


def gpt_oss_reference(ctx, batched=8192, memory_gib=40, bs=64):
    """gpt-oss-20b by hand: 12 full layers hold every block, 12 sliding layers (window_left 127)
    only the window's; a page is one block of all 12 layers of one kind; one step's prefill
    (``batched`` tokens) is kept free on the sliding layers, spread over at most
    ``ceil(batched / ctx) + 1`` requests, each holding at most what it releases."""
    page = 12 * 8 * bs * (64 + 64) * 2
    pages = int(memory_gib * GIB) // (2 * page) * 2  # FastDeploy blocks, two pages each
    full = fd_blocks_per_request(ctx, bs)
    released = max(0, ctx - 127) // bs  # block k goes once (k + 1) * bs <= ctx - window_left
    sliding = full - released
    chunk = min(math.ceil(batched / bs), (math.ceil(batched / ctx) + 1) * released)
    return (pages - chunk) // (full + sliding), full + sliding, chunk


def test_gpt_oss_recycling_matches_a_hand_count(capsys):
    d = plan_json(capsys, "gpt-oss-20b", "--context", "8192")
    assert {(x["kind"], x["window_left"]) for x in d["layers"]} == {("sliding", 127), ("full", None)}
    (row,) = d["pools"]["contexts"]
    requests, pages, chunk = gpt_oss_reference(8192)
    # the brief's form of the sliding layers' blocks agrees at 8192
    assert pages == 2 * math.ceil((8192 + 140) / 64) - (8192 - 128) // 64
    assert (row["recycling_requests"], row["pages_per_request"], row["transient_pages"]) == (
        requests,
        pages,
        chunk,
    )
    assert (row["fastdeploy_requests"], requests) == (104, 199)
    assert d["pools"]["num_gpu_blocks"] == d["pools"]["fastdeploy_num_blocks"] == 40 * GIB // (3 << 20)


@pytest.mark.parametrize("batched", [64, 2048, 100000])
def test_gpt_oss_max_num_batched_tokens(capsys, batched):
    contexts = (256, 2048, 8192)
    d = plan_json(
        capsys, "gpt-oss-20b", "--context", ctx_arg(contexts), "--max-num-batched-tokens", str(batched)
    )
    assert d["pools"]["max_num_batched_tokens"] == batched
    for ctx, row in zip(contexts, d["pools"]["contexts"], strict=True):
        requests, pages, chunk = gpt_oss_reference(ctx, batched)
        assert (row["recycling_requests"], row["pages_per_request"], row["transient_pages"]) == (
            requests,
            pages,
            chunk,
        )


def test_max_model_len_beyond_the_contexts(capsys):
    """Short requests, long max_model_len: the rows are the short ones; the fit is checked at
    max_model_len (FastDeploy alone needs max_model_len // bs + 2 blocks)."""
    d = plan_json(capsys, "gpt-oss-20b", "--context", "256,1024", "--max-model-len", "32768")
    pools = d["pools"]
    assert [r["context"] for r in pools["contexts"]] == [256, 1024]
    assert pools["max_model_len"] == 32768 and pools["fastdeploy_min_gpu_blocks"] == 32768 // 64 + 2
    assert pools["min_gpu_blocks"] <= pools["fastdeploy_min_gpu_blocks"] <= pools["num_gpu_blocks"]
    assert d["kv_cache"]["context"] == 1024 and d["warnings"] == []


def test_cannot_hold_one_max_model_len_request(capsys):
    d = plan_json(
        capsys, "gpt-oss-20b", "--context", "256", "--max-model-len", "1000000", "--memory-gib", "1"
    )
    assert isinstance(d["pools"], str)
    assert "max_model_len=1000000" in d["pools"] and "refuses to start" in d["pools"]
    assert any("max_model_len=1000000" in w for w in d["warnings"])
    assert (
        main(["plan", "gpt-oss-20b", "--context", "256", "--max-model-len", "1000000", "--memory-gib", "1"])
        == 0
    )
    out = capsys.readouterr().out
    assert "WARNING: window recycling: one request of max_model_len=1000000" in out


def test_nothing_to_recycle_is_a_message(capsys):
    d = plan_json(capsys, "deepseek-v3", "--context", "256,1024")
    assert d["pools"].startswith("no lane slides on every rank")
    assert main(["plan", "deepseek-v3", "--context", "256,1024"]) == 0
    assert "no lane slides on every rank" in capsys.readouterr().out


def test_padding_is_priced(capsys):
    """tiny's layers differ in head dims: the pool buys fewer blocks than FastDeploy's accounting,
    and the FastDeploy column is still FastDeploy's own count."""
    d = plan_json(capsys, "tiny", "--context", "16,64,256", "--block-size", "16", "--memory-gib", "0.01")
    pools = d["pools"]
    assert pools["layout"]["padding"] > 0 and pools["num_gpu_blocks"] < pools["fastdeploy_num_blocks"]
    for r in pools["contexts"]:
        assert r["fastdeploy_requests"] == fd_reference(d["layers"], r["context"], 0.01, 16), r


def test_text_report_has_one_row_per_context(capsys):
    assert main(["plan", "gpt-oss-20b", "--context", "256,2048,8192"]) == 0
    out = capsys.readouterr().out
    report = out[out.index("Window recycling") :].splitlines()
    assert "2 pages per FastDeploy block" in report[1] and "no padding" in report[1]
    assert "1 sliding (8 kv heads, 1 lane, window_left 127), 1 full" in report[2]
    assert "13653 FastDeploy blocks" in report[3] and "27306 pages" in report[3]
    assert report[4].split()[:2] == ["max_model_len", "8192:"] and "fits" in report[4]
    header = report[5].split()
    assert header[:4] == ["context", "FastDeploy", "recycling", "ratio"]
    rows = {int(line.split()[0]): line.split()[1:4] for line in report[6:9]}
    expected = {}
    for ctx in (256, 2048, 8192):
        fd, ours = 13653 // fd_blocks_per_request(ctx, 64), gpt_oss_reference(ctx)[0]
        expected[ctx] = [str(fd), str(ours), f"x{ours / fd:.2f}"]
    assert rows == expected
    assert rows[8192][:2] == ["104", "199"]
    assert "context 8192" in out  # the per-layer budget at the longest


def test_single_context_still_an_int(capsys):
    d = plan_json(capsys, "gpt-oss-20b", "--context", "2048")
    assert d["kv_cache"]["context"] == 2048 and d["pools"]["max_model_len"] == 2048
    assert [r["context"] for r in d["pools"]["contexts"]] == [2048]


@pytest.mark.parametrize(
    "value,fragment",
    [
        ("256,x", "'x'"),
        ("0", "'0'"),
        ("256,-1", "'-1'"),
        ("1.5", "'1.5'"),
        ("256,,512", "'256,,512'"),
        ("256,", "'256,'"),
        ("", "''"),
        ("256,2048,256", "256 is given twice"),
        ("2147483647", "2147483647"),  # no room for FastDeploy's look-ahead in int32 lengths
    ],
)
def test_bad_context(capsys, value, fragment):
    assert exit_code(["plan", "gpt-oss-20b", "--context", value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--context" in err and fragment in err, err


def test_context_longer_than_max_model_len_is_refused(capsys):
    assert exit_code(["plan", "gpt-oss-20b", "--context", "256,4096", "--max-model-len", "2048"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--context 256,4096" in err and "--max-model-len 2048" in err and "4096" in err


@pytest.mark.parametrize(
    "flags",
    [
        ("--max-model-len", "0"),
        ("--max-model-len", "x"),
        ("--max-model-len", "2147483647"),
        ("--max-num-batched-tokens", "0"),
        ("--max-num-batched-tokens", "1e4"),
    ],
)
def test_bad_max_flags(capsys, flags):
    assert exit_code(["plan", "gpt-oss-20b", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flags[0] in err and flags[1] in err, err


def test_context_mix_subprocess():
    r = fdfleet("plan", "gemma3-27b", "--context", "128,256,1024,2048,4096,8192", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["pools"]["contexts"]
    assert [x["context"] for x in rows] == [128, 256, 1024, 2048, 4096, 8192]
    r = fdfleet("plan", "gemma3-27b", "--context", "128,abc")
    assert r.returncode == 2 and "--context" in r.stderr and "'abc'" in r.stderr and r.stdout == ""


# ---- quantized KV caches (issue 31): codes one byte each, block_wise_fp8 adds scales --------------
#
# Independent count: per token, layer l holds Hkv_l * (qk_l + v_l) one-byte codes and, for
# block_wise_fp8, one K and one V scale per kv head in the model dtype (2 bytes for bf16).


def quant_fd_reference(layers, ctx, memory_gib=40, bs=64, scale_bytes=2):
    """FastDeploy's allocation of a block_wise_fp8 cache, honestly priced, by hand: max concurrent
    requests of ``ctx`` tokens (its 2-block decode look-ahead included)."""
    codes = sum(x["num_kv_heads"] * (x["qk_head_dim"] + x["v_head_dim"]) for x in layers)
    scales = sum(2 * x["num_kv_heads"] * scale_bytes for x in layers)
    price = bs * (codes + scales)
    return int(memory_gib * GIB) // price // fd_blocks_per_request(ctx, bs)


def quant_claimed_blocks(layers, memory_gib=40, bs=64):
    """Blocks FastDeploy's own cal_theortical_kvcache claims: byte_of_dtype = 1, no scales."""
    return int(memory_gib * GIB) // (
        bs * sum(x["num_kv_heads"] * (x["qk_head_dim"] + x["v_head_dim"]) for x in layers)
    )


@pytest.mark.parametrize("preset", SLIDING_PRESETS)
def test_block_wise_fp8_nearly_doubles_concurrency(capsys, preset):
    bf16 = plan_json(capsys, preset, "--context", "8192")
    fp8 = plan_json(capsys, preset, "--context", "8192", "--kv-cache-quant", "block_wise_fp8")
    layers = fp8["layers"]
    # bytes per token: codes + 2 scales per kv head per layer, against 2 bytes per element
    codes = sum(x["num_kv_heads"] * (x["qk_head_dim"] + x["v_head_dim"]) for x in layers)
    heads = sum(x["num_kv_heads"] for x in layers)
    assert fp8["kv_cache"]["bytes_per_token"] == codes + 2 * heads * 2
    assert bf16["kv_cache"]["bytes_per_token"] == 2 * codes
    assert fp8["kv_cache"]["kv_cache_quant"] == "block_wise_fp8"
    # without recycling (per-layer sizing, no look-ahead): >= 1.9x
    n_bf16, n_fp8 = bf16["kv_cache"]["max_requests"], fp8["kv_cache"]["max_requests"]
    per_request = -(-8192 // 64) * 64
    assert n_fp8 == int(40 * GIB) // (per_request * (codes + 4 * heads))
    assert n_fp8 >= 1.9 * n_bf16, (n_fp8, n_bf16)
    # FastDeploy's accounting (look-ahead included) and recycling, both quantized: >= 1.9x each
    (row_bf16,) = bf16["pools"]["contexts"]
    (row_fp8,) = fp8["pools"]["contexts"]
    assert row_fp8["fastdeploy_requests"] == quant_fd_reference(layers, 8192)
    assert row_fp8["fastdeploy_requests"] >= 1.9 * row_bf16["fastdeploy_requests"]
    assert row_fp8["recycling_requests"] >= 1.9 * row_bf16["recycling_requests"]
    # recycling never serves fewer than FastDeploy's (honest) accounting
    assert row_fp8["recycling_requests"] >= row_fp8["fastdeploy_requests"]
    # FastDeploy's own count leaves the scales out: it claims more blocks than the memory holds
    pools = fp8["pools"]
    assert pools["fastdeploy_claimed_num_blocks"] == quant_claimed_blocks(layers)
    assert pools["fastdeploy_claimed_num_blocks"] > pools["fastdeploy_num_blocks"]
    assert pools["page_bytes"] * pools["layout"]["pages_per_block"] == 64 * (codes + 4 * heads)


@pytest.mark.parametrize("preset", SLIDING_PRESETS)
@pytest.mark.parametrize("quant", ["float8_e4m3fn", "cache_int8"])
def test_static_quant_counts_codes_only(capsys, preset, quant):
    """Static formats keep their scales as per-layer parameters ([kv_heads] or [kv_heads * D]), not
    per token: a block is its codes, and FastDeploy's own count is then right."""
    d = plan_json(capsys, preset, "--context", "256,8192", "--kv-cache-quant", quant)
    layers = d["layers"]
    codes = sum(x["num_kv_heads"] * (x["qk_head_dim"] + x["v_head_dim"]) for x in layers)
    assert d["kv_cache"]["bytes_per_token"] == codes
    pools = d["pools"]
    assert (
        pools["fastdeploy_claimed_num_blocks"]
        == pools["fastdeploy_num_blocks"]
        == quant_claimed_blocks(layers)
    )
    for row in pools["contexts"]:
        assert row["recycling_requests"] >= row["fastdeploy_requests"] >= 1


@pytest.mark.parametrize("preset", SLIDING_PRESETS)
def test_block_wise_fp8_recycling_never_serves_fewer(capsys, preset):
    d = plan_json(capsys, preset, "--context", ctx_arg(CONTEXTS), "--kv-cache-quant", "block_wise_fp8")
    for r in d["pools"]["contexts"]:
        assert r["fastdeploy_requests"] == quant_fd_reference(d["layers"], r["context"]), r
        assert r["recycling_requests"] >= r["fastdeploy_requests"] >= 1, r
    assert d["pools"]["min_gpu_blocks"] <= d["pools"]["fastdeploy_min_gpu_blocks"]


# -- issue 33: the FDFLEET_KV_RECYCLE in effect, the FastDeploy flags, the quantized cache's format


@pytest.mark.parametrize(
    "env,value,source",
    [(None, "auto", "default"), ("", "auto", "default"), ("off", "off", "env"), (" AUTO ", "auto", "env")],
)
def test_header_shows_the_recycle_value_in_effect(capsys, monkeypatch, env, value, source):
    if env is None:
        monkeypatch.delenv("FDFLEET_KV_RECYCLE", raising=False)
    else:
        monkeypatch.setenv("FDFLEET_KV_RECYCLE", env)
    assert main(["plan", "gpt-oss-20b"]) == 0
    out = capsys.readouterr().out
    where = "from the environment" if source == "env" else "the default"
    assert f"Window recycling (FDFLEET_KV_RECYCLE={value}, {where})" in out
    assert value == "auto" or "FDFLEET_KV_RECYCLE=auto" not in out
    assert ("OFF" in out) == (value == "off")
    d = plan_json(capsys, "gpt-oss-20b")
    assert d["recycle"] == {"value": value, "source": source, "in_effect": value == "auto"}
    assert d["fastdeploy_flags"]["env"]["FDFLEET_KV_RECYCLE"] == value


def test_bad_recycle_value_exits_2(monkeypatch):
    r = subprocess.run(
        [sys.executable, "-m", "fastdeploy_paddlefleet.cli", "plan", "tiny"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**__import__("os").environ, "FDFLEET_KV_RECYCLE": "sometimes"},
    )
    assert r.returncode == 2 and "FDFLEET_KV_RECYCLE" in r.stderr and "'sometimes'" in r.stderr


def test_quant_text_names_the_format_and_counts_scales(capsys):
    """block_wise_fp8 at gpt-oss-20b: 24 layers x 8 kv heads x (64 + 64) codes + 2 bf16 scales per
    token and kv head = 24 * 8 * (128 + 4) = 25344 bytes per token (bf16: 49152)."""
    assert main(["plan", "gpt-oss-20b", "--kv-cache-quant", "block_wise_fp8"]) == 0
    out = capsys.readouterr().out
    assert "KV cache per rank (block_wise_fp8 codes, bf16 model" in out
    assert "(block_wise_fp8 cache, codes and scales counted)" in out
    d = plan_json(capsys, "gpt-oss-20b", "--kv-cache-quant", "block_wise_fp8")
    assert d["kv_cache"]["bytes_per_token"] == 24 * 8 * (128 + 4) == 25344
    # a FastDeploy block of 64 tokens: 64 * 25344 bytes; 40 GiB buy 40 * 2**30 // 1622016 of them
    assert d["pools"]["fastdeploy_num_blocks"] == 40 * 2**30 // (64 * 25344) == 26479
    assert d["fastdeploy_flags"]["num_gpu_blocks_override"] == 26479
    assert d["fastdeploy_flags"]["quantization"] == {
        "quantization": "mix_quant",
        "kv_cache_quant_type": "block_wise_fp8",
    }


def test_fastdeploy_flags_gpt_oss_by_hand(capsys):
    """gpt-oss-20b, 40 GiB, block 64, bf16, 8192 tokens, by hand: a FastDeploy block is 24 layers x
    8 kv heads x 64 tokens x (64 + 64) x 2 bytes = 3 MiB, 40 GiB buy 13653. A request of 8192
    tokens with the 2-block + 12-slot look-ahead holds ceil(8332 / 64) = 131 blocks of full layers
    (131 pages) and, on the sliding lane, the blocks of [8192 - 127, 8332): 64 // 64 .. 130 = 5
    pages: 136 pages. The pool has 2 * 13653 = 27306 pages, less one 8192-token prefill chunk (128
    pages) on the sliding lane: (27306 - 128) // 136 = 199."""
    d = plan_json(capsys, "gpt-oss-20b")
    f = d["fastdeploy_flags"]
    block = 24 * 8 * 64 * 128 * 2
    assert block == 3 * 2**20 and f["block_bytes"] == block
    assert f["num_gpu_blocks_override"] == 40 * 2**30 // block == 13653
    pages = -(-(8192 + 2 * 64 + 12) // 64) + (130 - (8192 - 127) // 64 + 1)
    assert pages == 136
    assert f["supported_requests"] == (2 * 13653 - 8192 // 64) // pages == 199
    assert f["max_num_seqs"] == 199
    assert (f["block_size"], f["max_model_len"], f["max_num_batched_tokens"]) == (64, 8192, 8192)
    assert f["env"] == {"FD_PLUGINS": "paddlefleet", "FDFLEET_KV_RECYCLE": "auto"}
    assert f["quantization"] is None and f["model_impl"] == "paddlefleet"
    argv = f["argv"]
    pairs = dict(zip(argv[::2], argv[1::2], strict=True))
    assert pairs == {
        "--model-impl": "paddlefleet",
        "--tensor-parallel-size": "1",
        "--block-size": "64",
        "--max-model-len": "8192",
        "--max-num-batched-tokens": "8192",
        "--max-num-seqs": "199",
        "--num-gpu-blocks-override": "13653",
    }
    assert main(["plan", "gpt-oss-20b"]) == 0
    out = capsys.readouterr().out
    assert "FastDeploy flags" in out and "FD_PLUGINS=paddlefleet" in out
    assert "--max-num-seqs 199 --num-gpu-blocks-override 13653" in out


def test_quantized_flags_name_the_dequant_scratch(capsys, monkeypatch):
    """A quantized cache's flags note the memory the Hopper prefill's dequant scratch takes beside the KV
    memory, at FDFLEET_DEQUANT_SCRATCH_MB's value; an unquantized cache's say nothing of it."""
    monkeypatch.setenv("FDFLEET_DEQUANT_SCRATCH_MB", "96")
    notes = plan_json(capsys, "gpt-oss-20b", "--kv-cache-quant", "block_wise_fp8")["fastdeploy_flags"][
        "notes"
    ]
    assert [n for n in notes if "96 MiB" in n and "FDFLEET_DEQUANT_SCRATCH_MB" in n]
    plain = plan_json(capsys, "gpt-oss-20b")["fastdeploy_flags"]["notes"]
    assert not [n for n in plain if "FDFLEET_DEQUANT_SCRATCH_MB" in n]


def test_fastdeploy_flags_cap_and_off(capsys, monkeypatch):
    """Short requests: the memory holds thousands, FastDeploy's FDConfig.check caps max_num_seqs at
    512; with FDFLEET_KV_RECYCLE=off the flags count FastDeploy's accounting (a 256-token request
    with the 2-block + 12-slot look-ahead holds ceil(396 / 64) = 7 blocks: 13653 // 7 = 1950)."""
    monkeypatch.setenv("FDFLEET_KV_RECYCLE", "off")
    f = plan_json(capsys, "gpt-oss-20b", "--context", "256,8192")["fastdeploy_flags"]
    assert f["recycling"] is False and f["env"]["FDFLEET_KV_RECYCLE"] == "off"
    assert f["num_gpu_blocks_override"] == 13653 and f["context"] == 256
    assert f["supported_requests"] == 13653 // -(-(256 + 2 * 64 + 12) // 64) == 1950
    assert f["max_num_seqs"] == 512 and "512" in f["notes"][0]


def test_fastdeploy_flags_mimo_off_uses_the_uniform_shape(capsys, monkeypatch):
    """MiMo-V2-Flash-like without recycling: FastDeploy's one cache shape sizes every layer like
    the widest, 8 kv heads and ONE head dim for K and V (192, the v 128 padded), so the override is
    what that shape buys, not the per-layer count (which would over-commit the memory)."""
    monkeypatch.setenv("FDFLEET_KV_RECYCLE", "off")
    d = plan_json(capsys, "mimo-v2-flash-like")
    layers = d["layers"]
    hkv = max(x["num_kv_heads"] for x in layers)
    dims = 2 * max(max(x["qk_head_dim"], x["v_head_dim"]) for x in layers)
    uniform_block = len(layers) * hkv * 64 * dims * 2
    f = d["fastdeploy_flags"]
    assert f["num_gpu_blocks_override"] == 40 * 2**30 // uniform_block
    assert f["num_gpu_blocks_override"] < d["pools"]["fastdeploy_num_blocks"]


def test_fastdeploy_flags_nothing_to_recycle_keeps_the_env_value(capsys, monkeypatch):
    """tiny-mla slides nowhere: the flags keep FDFLEET_KV_RECYCLE as set (auto) and count
    FastDeploy's one cache shape (every layer's key and value at the widest head dim)."""
    monkeypatch.delenv("FDFLEET_KV_RECYCLE", raising=False)
    d = plan_json(capsys, "tiny-mla")
    f = d["fastdeploy_flags"]
    assert f["env"]["FDFLEET_KV_RECYCLE"] == "auto" and f["recycling"] is False
    assert f["block_bytes"] == d["kv_cache"]["fastdeploy_uniform"]["bytes_per_block_uniform"]
    assert f["num_gpu_blocks_override"] == 40 * 2**30 // f["block_bytes"]
    assert d["recycle"] == {"value": "auto", "source": "default", "in_effect": False}
