"""benchmarks/attention.py keeps running: every issue-4 case at --smoke shapes (CPU interpreter), checked
against the dense reference inside the script (its max_abs_err field)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "decode-full",
    "decode-swa1024",
    "decode-swa1024-sinks",
    "decode-headwise",
    "prefill-causal",
    "prefill-swa1024",
    "prefill-swa1024-sinks",
    "mixed",
    "mla-decode",
    "mla-prefill-causal",
    "gptoss-prefill-swa128-sinks",
}


@pytest.mark.slow
def test_attention_benchmark_smoke(tmp_path):
    pytest.importorskip("triton")
    pytest.importorskip("torch")
    out = tmp_path / "smoke.jsonl"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT / "src"))
    script = ROOT / "benchmarks" / "attention.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--smoke", "--no-peers", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ours = {r["case"]: r for r in rows if r.get("impl") == "triton" and r.get("kind") != "host"}
    assert set(ours) == CASES
    for case, row in ours.items():
        assert "error" not in row, (case, row)
        assert row["max_abs_err"] < 1e-4, (case, row)  # fp32 at --smoke shapes on the CPU
    host = [r for r in rows if r.get("kind") == "host"]  # host cost per eager launch (issue 20)
    assert host and all("error" not in r and r["us"] > 0 for r in host), host
    assert out.with_suffix(".png").exists()


def test_gather_timing_runs_the_plans_own_gather(monkeypatch):
    """``attention.gather_timing``: the dequantizing gather of the plan the quantized prefill runs, timed
    alone (here on the interpreter, the plan made to choose the Hopper path); a plan without a gather is
    reported, not raised."""
    pytest.importorskip("triton")
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import attention

    from fastdeploy_paddlefleet.kernels import paged_attention as pa

    monkeypatch.setitem(attention.SH, "dev", "cpu")
    monkeypatch.setitem(attention.SH, "dtype", "float32")  # the interpreter's dots: fp32
    batch = attention.paged_batch([0, 30], [40, 1], 4, 2, 16, 16, seed=1)
    assert batch["q"].dtype == torch.float32
    assert "gather_error" in attention.gather_timing(batch, "block_wise_fp8", max_q_len=40, max_ctx=40)
    monkeypatch.setattr(pa, "choose_prefill_impl", lambda *a, **k: "hopper")
    got = attention.gather_timing(batch, "block_wise_fp8", max_q_len=40, max_ctx=40)
    assert set(got) == {"gather_ms"} and got["gather_ms"] > 0


def test_quantized_decode_records_time_the_layout_the_plan_did_not_take(monkeypatch):
    """``attention._key_rows_layouts``: a quantized decode or mixed case is timed under the plan's own
    decode layout and the other one (key rows where the plan takes query rows, and back), following
    ``paged_attention.key_rows_by_default``, ``FDFLEET_DECODE_KEY_ROWS`` and a forced module setting;
    other kinds only under the plan's own."""
    torch = pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import attention

    from fastdeploy_paddlefleet.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "DECODE_KEY_ROWS", None)
    monkeypatch.delenv("FDFLEET_DECODE_KEY_ROWS", raising=False)

    def batch(d=128, headwise=False):
        return {"q": torch.zeros(2, 8, d), "vc": torch.zeros(1, 2, 4, d), "headwise": headwise}

    dec = {"kind": "decode"}
    assert attention._key_rows_layouts(dec, batch(), "block_wise_fp8", None) == [None, False]
    assert attention._key_rows_layouts({"kind": "mixed"}, batch(), "block_wise_fp8", None) == [None, False]
    assert attention._key_rows_layouts(dec, batch(headwise=True), "block_wise_fp8", None) == [None, True]
    assert attention._key_rows_layouts(dec, batch(64), "block_wise_fp8", None) == [None, True]
    assert attention._key_rows_layouts(dec, batch(192), "block_wise_fp8", 128) == [None, False]  # MLA
    assert attention._key_rows_layouts(dec, batch(), "int8", None) == [None, True]
    assert attention._key_rows_layouts({"kind": "prefill"}, batch(), "block_wise_fp8", None) == [None]
    monkeypatch.setenv("FDFLEET_DECODE_KEY_ROWS", "0")
    assert attention._key_rows_layouts(dec, batch(), "block_wise_fp8", None) == [None, True]
    monkeypatch.setattr(pa, "DECODE_KEY_ROWS", True)  # --decode-key-rows on
    assert attention._key_rows_layouts(dec, batch(headwise=True), "int8", None) == [None, False]


@pytest.mark.slow
def test_attention_sweep_times_every_fp8_decode_variant(tmp_path):
    """``--sweep --cases decode --kv-cache-quant block_wise_fp8``: one record per listed fp8 decode variant
    of both decode cases (tile, splits, register cap, code mode), each checked against the dense reference
    on the dequantized cache, and no prefill variant (not asked for)."""
    pytest.importorskip("triton")
    pytest.importorskip("torch")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import attention
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    out = tmp_path / "sweep.jsonl"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT / "src"))
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "attention.py"),
        "--smoke",
        "--sweep",
        "--cases",
        "decode",
    ]
    cmd += ["--kv-cache-quant", "block_wise_fp8", "--no-peers", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    fp8 = [r for r in rows if r.get("kv_cache_dtype") == "block_wise_fp8"]
    want = {(name, v) for name, variants in attention.FP8_DECODE_VARIANTS.items() for v in variants}
    keys = ("block_n", "warps", "stages", "splits", "maxnreg", "f16_codes", "key_rows")
    got = {(r["sweep"], tuple(r[k] for k in keys)) for r in fp8}
    assert got == want
    for r in fp8:
        assert "error" not in r and r["max_abs_err"] < 1e-4, r
    assert not [r for r in rows if str(r.get("sweep", "")).startswith("prefill")]


@pytest.mark.parametrize(
    "args, named",
    [
        (["--smoke", "--out", "benchmarks/results/attention-h200.jsonl"], "committed results"),
        (["--out", "results.png"], "--out"),
        (["--out", "x.jsonl", "--plot", "plot.jsonl"], "--plot"),
    ],
)
def test_attention_benchmark_refuses_outputs_before_any_work(args, named, tmp_path):
    """A smoke run never writes the committed results; a mismatched extension is refused by flag; in
    every case no file changes (checked byte for byte on the committed results)."""
    committed = ROOT / "benchmarks" / "results" / "attention-h200.jsonl"
    before = committed.read_bytes()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "attention.py"), *args],
        cwd=ROOT if args[-1].startswith("benchmarks/") else tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert named in proc.stderr
    assert committed.read_bytes() == before
    assert list(tmp_path.iterdir()) == []


def _serving_sim():
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    import serving_sim

    return serving_sim


def test_serving_sim_decode_bound_matches_a_hand_count_for_gpt_oss():
    """The step-model bound of benchmarks/serving_sim.py against numbers counted from the
    gpt-oss-20b preset by hand: 24 layers (12 full, 12 sliding that read 128 keys, the current one included),
    8 kv heads of 64 (K and V), bf16; 20.9B bf16 weights; an H200's budget; block 64. The one pool: a
    FastDeploy block (every layer) is 2 pages (12 full layers of 8 heads, 12 sliding ones), a page of
    the full lane per block of the context, of the sliding lane only the blocks its 127-token window
    still sees."""
    ss = _serving_sim()
    bw, hbm = 4231.1e9, 143771 * 2**20
    weights = 20.9e9 * 2
    kv_budget = int(0.9 * hbm - weights - 4e9)
    per_token_layer = 8 * (64 + 64) * 2  # bytes of one layer's K and V for one token
    block = 64 * 24 * per_token_layer  # FastDeploy's block: every layer
    prompt, out = 7168, 1024
    c = prompt + out // 2
    num_blocks = kv_budget // block
    held = c + 2 * 64 + 12  # FastDeploy's decode look-ahead: 2 blocks + 12 slots
    b_fd = num_blocks // -(-held // 64)  # FastDeploy's blocks per request
    # recycling at c: the full lane holds every block of [0, held); the sliding lane (window_left 127)
    # the blocks of [c - 127, held); one step's prefill (8192 tokens = 128 pages) on the sliding lane
    full_pages = -(-held // 64)
    sliding_pages = full_pages - (c - 127) // 64
    assert (full_pages, sliding_pages) == (123, 5)
    b_rc = (2 * num_blocks - 8192 // 64) // (full_pages + sliding_pages)
    t_kv = (12 * per_token_layer * c + 12 * per_token_layer * 128 + 24 * per_token_layer) / bw
    t_w = 1e-3 + weights / bw  # overhead + every weight once (every expert is hit at this batch)

    b = ss.decode_bound("gpt-oss-20b", prompt, out, None)
    assert b["kv_bytes"] == kv_budget and b["fastdeploy_requests"] == b_fd
    assert b["recycling_requests"] == b_rc
    assert b["t_kv_us"] == pytest.approx(t_kv * 1e6, rel=1e-9)
    assert b["t_w_ms"] == pytest.approx(t_w * 1e3, rel=1e-6)
    r = b_rc / b_fd
    assert b["r"] == pytest.approx(r) and 1.85 < r < 2.0  # (G = 1.95 at 8k)
    expected = r * (t_w + b_fd * t_kv) / (t_w + r * b_fd * t_kv)
    assert b["gain_bound"] == pytest.approx(expected, rel=1e-6)
    assert b["gain_bound_exact"] == pytest.approx(expected, rel=1e-3)
    assert b["gain_bound_r_inf"] == pytest.approx(1 + t_w / (b_fd * t_kv), rel=1e-6)
    # a cap both modes reach leaves nothing to gain
    capped = ss.decode_bound("gpt-oss-20b", prompt, out, b_fd)
    assert capped["r"] == 1.0 and capped["gain_bound"] == pytest.approx(1.0)


@pytest.mark.slow
def test_decode_ceiling_smoke(tmp_path):
    """benchmarks/probes/decode_ceiling.py at --smoke shapes: the plain reader's sums over each layout equal
    torch's (checked inside the script: it raises otherwise) and our kernel matches the dense reference."""
    pytest.importorskip("triton")
    pytest.importorskip("torch")
    out = tmp_path / "ceiling.jsonl"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT / "src"))
    script = ROOT / "benchmarks" / "probes" / "decode_ceiling.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--smoke", "--json", "--out", str(out), "--tag", "run=smoke"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    impls = {r["impl"] for r in rows}
    assert impls == {"read-paged-random", "read-paged-ordered", "read-contiguous", "triton-paged-random",
                     "triton-paged-ordered", "triton-contiguous"}  # fmt: skip
    assert all("error" not in r and r["run"] == "smoke" for r in rows), rows
    assert all(r["max_abs_err"] < 1e-4 for r in rows if r["impl"].startswith("triton")), rows
    assert set(json.loads(proc.stdout.splitlines()[-1])["gbps"]) == impls


def _bench_module(name: str):
    """A research probe of ``benchmarks/probes/`` imported by name (it finds ``benchmarks/`` itself)."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "probes"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks" / "probes"))


def test_decode_probe_stamps_the_current_kernel():
    """benchmarks/probes/decode_probe.py's stamp points still match the decode kernel's source (each
    anchor found exactly once), every variant's copy is valid Python, and a changed kernel names the moved
    anchor."""
    probe = _bench_module("decode_probe")
    for variant in probe.VARIANTS:
        text = probe.patched_source(variant=variant)
        compile(text, "decode_probe_kernels.py", "exec")
        assert text.count("_probe_time(") == 3  # the helper, the start and the end of a program
        assert text.count("Trace + pid") == 3
    assert probe.patched_source(variant="evict-first").count('eviction_policy="evict_first"') == 2
    with pytest.raises(ValueError, match="stamp point 'stamp helpers'"):
        probe.patched_source("def nothing(): pass\n")


def test_decode_probe_timeline_counts_running_programs():
    """decode_probe.timeline on a hand-made trace: 4 programs of 1 us on 2 slots, the second pair started
    as the first ended, the last one 0.5 us late: span, peak, waves and the 2 us bins are as counted."""
    probe = _bench_module("decode_probe")
    ns = 1000
    trace = [[1 * ns, 2 * ns, 0, 0], [1 * ns, 2 * ns, 1, 0], [2 * ns, 3 * ns, 0, 0], [2500, 3500, 1, 0]]
    t = probe.timeline(trace, kv_bytes=4000)
    assert t["programs"] == 4 and t["sms"] == 2 and t["peak_active"] == 2
    assert t["span_us"] == 2.5 and t["first_end_us"] == 1.0 and t["last_start_us"] == 1.5
    assert t["ramp_us"] == 0.0 and t["tail_us"] == 0.5  # one program runs alone for the last 0.5 us
    assert t["first_wave_us"] == 1.0 and t["later_us"] == 1.0
    # time-weighted programs per 2 us bin: [0, 2) us holds 1 + 1 + 1 + 0.5 us, [2, 4) the last 0.5 us
    assert t["active_2us"] == [1.8, 0.2]  # rounded to one decimal: 1.75, 0.25
    assert t["mean_active"] == pytest.approx(4 / 2.5, abs=0.05)


def test_hopper_probe_stamps_the_current_kernel():
    """benchmarks/probes/hopper_probe.py's stamp points still match the Hopper kernel's source (each
    anchor found exactly as often as expected), and the stamped copy is valid Python with every stamp in
    it."""
    hopper_probe = _bench_module("hopper_probe")
    text = hopper_probe.patched_source()
    compile(text, "hopper_probe_kernel.py", "exec")
    assert text.count("_stamp(Trace, tb, ") == 9  # 4 in the consumers' loop, 5 in the producer's
    with pytest.raises(ValueError, match="stamp point 'stamp helper'"):
        hopper_probe.patched_source("def nothing(): pass\n")


def test_portable_compile_probe_builds_the_masked_tiles_half_width():
    """benchmarks/probes/portable_compile.py compiles the portable prefill for sm_90 without a GPU (the
    check behind NOTES.md's register table) and reports the masked loops' 32-key tiles."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "probes" / "portable_compile.py"), "--case", "causal",
         "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads(proc.stdout.splitlines()[-1])
    assert rec["case"] == "causal" and rec["block_nm"] == 32 and rec["regs"] > 0, rec


def test_fp8_decode_reads_v_codes_without_byte_loads_when_converted_where_loaded():
    """benchmarks/probes/portable_compile.py's ``decode-fp8`` (sm_90 offline, the installed Triton): with
    ``F16_CODES`` 1 V's e4m3 codes reach ``P @ V`` one byte at a time (``LDS.U8``); 3
    (``attention_kernels._e4m3_as_f16_in_place``) converts them where loaded: no byte loads, and a
    shorter unmasked key loop (NOTES.md, "fp8 decode: V's codes one byte at a time")."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    recs = {}
    for mode in (1, 3):
        proc = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "probes" / "portable_compile.py"), "--case",
             "decode-fp8", "--f16-codes", str(mode), "--json"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        recs[mode] = json.loads(proc.stdout.splitlines()[-1])
    assert recs[1]["lds_u8"] > 0 and recs[3]["lds_u8"] == 0, recs
    assert recs[3]["inner_loops"][1] < recs[1]["inner_loops"][1], recs
