"""Smoke test of ``benchmarks/headwise_sim.py --quick``: JSON schema, and recycling never costs capacity."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SIM_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "headwise_sim.py"
RUN_KEYS = {
    "preset",
    "workload",
    "load",
    "mode",
    "requests",
    "rate_per_s",
    "kv_budget_bytes",
    "kv_used_bytes",
    "blocks_per_group",
    "output_throughput",
    "steady_output_throughput",
    "throughput_gain_vs_none",
    "max_concurrency",
    "capacity_at_final_len",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "preemptions",
    "timeline",
}


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location("headwise_sim", SIM_PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["headwise_sim"] = mod  # dataclasses look the module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def quick(sim, tmp_path_factory):
    out = tmp_path_factory.mktemp("sim") / "sim.json"
    assert sim.main(["--quick", "--out", str(out)]) == 0
    return json.loads(out.read_text()), out


def test_schema_and_plot(quick):
    res, out = quick
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert {"model", "workloads", "runs", "target"} <= set(res)
    assert {"gain_total", "gain_steady", "goal", "met"} <= set(res["target"])
    cases = {(r["preset"], r["workload"], r["load"]) for r in res["runs"]}
    assert len(cases) == 4  # 2 presets x (long, short) saturated
    for r in res["runs"]:
        assert RUN_KEYS <= set(r), RUN_KEYS - set(r)
        assert r["kv_used_bytes"] <= r["kv_budget_bytes"]
        assert r["output_throughput"] > 0 and r["ttft_p50_s"] <= r["ttft_p99_s"]
        lengths = res["workloads"][r["workload"]]
        assert r["output_tokens"] == sum(lengths[i % len(lengths)][1] for i in range(r["requests"]))


def test_recycling_never_lowers_capacity(quick):
    res, _ = quick
    by = {(r["preset"], r["workload"], r["mode"]): r for r in res["runs"]}
    for preset, workload, _ in list(by):
        none, layer, head = (by[(preset, workload, m)] for m in ("none", "layer", "headwise"))
        assert (
            none["capacity_at_final_len"] <= layer["capacity_at_final_len"] <= head["capacity_at_final_len"]
        )
        assert head["max_concurrency"] >= none["max_concurrency"]
    # the ERNIE preset slides 2 of 4 kv heads per layer with a 4k window: beyond 4k tokens it must gain
    ernie = by[("ernie-4.5-21b-a3b-headwise", "long", "headwise")]
    assert (
        ernie["capacity_at_final_len"]
        > 1.3 * by[("ernie-4.5-21b-a3b-headwise", "long", "none")]["capacity_at_final_len"]
    )
    # gpt-oss has no head-wise layers: layer-level recycling is already everything
    assert (
        by[("gpt-oss-20b", "long", "layer")]["capacity_at_final_len"]
        == by[("gpt-oss-20b", "long", "headwise")]["capacity_at_final_len"]
    )


def test_visible_key_counts(sim):
    for start, count, window in [(0, 10, None), (0, 10, 3), (5, 7, 3), (2, 4, 100), (40, 9, 0), (3, 1, 2)]:
        brute = sum(
            min(i + 1, (window if window is not None else 10**9) + 1) for i in range(start, start + count)
        )
        assert sim._keys_sum(start, count, window) == brute


def test_decode_step_time_by_hand(sim):
    """One decode token of a gpt-oss request at 1000 tokens: every term written out here."""
    m = sim.build_model("gpt-oss-20b")
    per_head = (64 + 64) * 2  # bytes of K + V of one kv head per token
    kv = 12 * 8 * per_head * 1000 + 12 * 8 * per_head * 128 + 24 * 8 * per_head  # full, sliding, write
    flops = 12 * 8 * 8 * 2 * 128 * 1000 + 12 * 8 * 8 * 2 * 128 * 128
    expert = (20.9e9 - 3.6e9) / (1 - 4 / 32)
    weights = (20.9e9 - expert) * 2 + expert * 2 * (4 / 32)
    expect = 1e-3 + max(weights / 4231.1e9, 2 * 3.6e9 / 776.5e12) + max(kv / 4231.1e9, flops / 298e12)
    assert sim.step_time(m, [1000], []) == pytest.approx(expect, rel=1e-9)
