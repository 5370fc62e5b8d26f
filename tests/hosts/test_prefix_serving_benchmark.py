"""``benchmarks/serving_sim.py --smoke --workload shared-prefix`` end to end (issue 32, item 5).

The tiny shared-prefix run (24 chats sharing a 512-token system prompt, FastDeploy's real
scheduler) in its three modes, written to a temporary directory: the same chats and KV bytes in
every mode, every requested token generated, FastDeploy's own count of cached tokens (each
request's ``metrics.gpu_cache_token_num``) non-zero where prefix caching is on and zero where it is
off, and the prefill the worker ran equal to the prompts less what FastDeploy served (no
preemption at this size). Figures are the benchmark's, not asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _fastdeploy_host import host_or_skip


@pytest.fixture(scope="module")
def host():
    pytest.importorskip("paddle", reason="FastDeploy's scheduler imports paddle")
    return host_or_skip()


def test_shared_prefix_benchmark_smoke(host, tmp_path):
    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FDFLEET_") and k != "FD_PLUGINS"}
    if host.path:
        env["FDFLEET_HOST_FASTDEPLOY"] = host.path
    out = tmp_path / "smoke.json"
    cmd = [
        sys.executable,
        str(repo / "benchmarks" / "serving_sim.py"),
        "--smoke",
        "--workload",
        "shared-prefix",
    ]
    proc = subprocess.run(
        [*cmd, "--out", str(out), "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["meta"]["smoke"] is True and (tmp_path / "smoke.png").stat().st_size > 0
    rows = {r["mode"]: r for r in data["rows"]}
    assert set(rows) == {"fastdeploy-prefix", "recycling", "recycling-prefix"}
    assert {r["workload"] for r in data["rows"]} == {"shared-prefix"}
    fdp, rc, both = rows["fastdeploy-prefix"], rows["recycling"], rows["recycling-prefix"]
    for r in rows.values():
        assert r["output_tokens"] == r["requested_output_tokens"] and r["tokens_per_s"] > 0, r
        assert r["ttft_p50_s"] > 0 and r["kv_bytes"] == 1 << 30, r
        # the same chats in every mode (history re-sent: the prompts depend on what was generated)
        assert r["prompt_tokens"] == fdp["prompt_tokens"] and r["requests"] == fdp["requests"] > 24, r
        assert r["recycling"] == (r["mode"] != "fastdeploy-prefix"), r
        if r["preempted"] == 0:  # what FastDeploy served from cache, the worker did not run
            assert r["prefill_tokens_run"] == r["prompt_tokens"] - r["cached_tokens_served"], r
    assert rc["pools"]["pages"] == rc["pools"]["pages_per_block"] * fdp["pools"]["blocks"]  # same bytes
    assert fdp["prefix_caching"] and fdp["cached_tokens_served"] > 0.3 * fdp["prompt_tokens"], fdp
    assert not rc["prefix_caching"] and rc["cached_tokens_served"] == rc["prefix_cache_token_num"] == 0, rc
    assert both["prefix_caching_asked"]
    if not both["prefix_caching"]:  # the hook switched it off: serves as "recycling" does
        assert both["cached_tokens_served"] == 0
    else:
        assert both["cached_tokens_served"] > 0, both
    for r in rows.values():
        assert r["prefix_cache_token_num"] >= r["cached_tokens_served"], r
    gains = data["prefix_gains"]
    assert list(gains) == ["gpt-oss-20b@2048 shared-prefix max_num_seqs=512"]
    assert next(iter(gains.values()))["prefix_caching_kept"] == both["prefix_caching"]
