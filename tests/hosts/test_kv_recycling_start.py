"""Window recycling never stops an engine from starting that FastDeploy alone starts (issue 29).

FastDeploy's ``EngineService`` builds ``ResourceManagerV1`` BEFORE profiling, on a placeholder
block count (``(max_num_batched_tokens / max_num_seqs + 2) * max_num_seqs`` blocks from
``CacheConfig.postprocess``), then, once the worker has measured the memory,
``CacheConfig.reset(num_gpu_blocks)`` (FastDeploy's own check) and
``resource_manager.reset_cache_config``. Each config below goes through exactly that order on
FastDeploy's real code (a fresh child process, ``FD_PLUGINS=paddlefleet``, recycling on by
default): the placeholder phase refuses nothing, the profiled count (40 GiB of KV at every layer's
own shape, or twice FastDeploy's own minimum where that is more) gives one pool of
``num_gpu_blocks * pages_per_block`` pages, a request is admitted and
allocated, FastDeploy's own minimum for ``max_model_len`` is accepted, and a count below the pool's
minimum (``reset_cache_config`` called past ``CacheConfig.reset``'s check) is refused in
FastDeploy's own words. The four configs of the issue were refused at the placeholder before.

FastDeploy's V0 scheduler (``ENABLE_V1_KVCACHE_SCHEDULER=0``, what FastDeploy picks on platforms it
does not serve on, CPU included) keeps its own accounting: building it for a recycling plan is
refused by name, and allowed with ``FDFLEET_KV_RECYCLE=off``.
"""

from __future__ import annotations

import json

import pytest
from _fastdeploy_host import host_or_skip, run_scenario

PLUGIN_ENV = {"FD_PLUGINS": "paddlefleet"}

#: (preset, max_model_len, max_num_seqs, max_num_batched_tokens): the four the static split refused at
#: FastDeploy's placeholder, then the capacity configs (tests/hosts/test_kv_recycling_scheduler.py)
CONFIGS = [
    ("gpt-oss-20b", 32768, 16, 512),
    ("gpt-oss-20b", 131072, 64, 8192),
    ("gemma3-27b", 131072, 32, 2048),
    ("ernie-4.5-21b-a3b-headwise", 32768, 64, 2048),
    *[
        (preset, mml, 512, 8192)
        for preset in ("gpt-oss-20b", "gemma3-27b", "mimo-v2-flash-like", "ernie-4.5-21b-a3b-headwise")
        for mml in (8192, 32768)
    ],
]

START = """
import json, os
import fastdeploy
import fastdeploy.envs as fd_envs
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.request import Request
from fastdeploy.engine.sampling_params import SamplingParams
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1
from fastdeploy_paddlefleet.plan import plan_from_config
from fastdeploy_paddlefleet.presets import load_preset
from fastdeploy_paddlefleet.serving.kv_recycling.scheduler import recycler_of

config = dict(load_preset(PRESET), torch_dtype="bfloat16")
os.makedirs(DIR, exist_ok=True)
with open(os.path.join(DIR, "config.json"), "w") as f:
    json.dump(config, f)

cfg = EngineArgs(
    model=DIR, model_impl="paddlefleet", max_model_len=MML, max_num_seqs=SEQS,
    max_num_batched_tokens=BATCHED, enable_chunked_prefill=True,
).create_engine_config()
fd_envs.ENABLE_V1_KVCACHE_SCHEDULER = 1  # FastDeploy picks V0 on CPU; the GPU engine runs V1
cc = cfg.cache_config
out = {"placeholder": cc.total_block_num, "architectures": list(cfg.model_config.architectures)}

rm = ResourceManagerV1(SEQS, cfg, 1, "mixed", 0)  # EngineService.__init__: before profiling
rec = recycler_of(rm)
out["placeholder_recycler"] = rec is not None and rec.placeholder
out["placeholder_pages"] = rec.num_pages if rec else None

# the worker's profile: 40 GiB of KV at every layer's own shape, bf16, FastDeploy's num_gpu_blocks
plan = plan_from_config(DIR)
price = cc.block_size * sum(la.num_kv_heads * (la.qk_head_dim + la.v_head_dim) * 2 for la in plan)
# (a 128k Gemma needs more than 40 GiB: FastDeploy alone refuses less than its minimum, so take twice that)
profiled = max((40 << 30) // price, 2 * (cc.max_block_num_per_seq + cc.enc_dec_block_num))
cc.reset(profiled)  # FastDeploy's own check first
rm.reset_cache_config(cc)
rec = recycler_of(rm)
out.update(profiled=profiled, pages=rec.num_pages, pages_per_block=rec.layout.pool.pages_per_block,
           placeholder_after=rec.placeholder, free_blocks=rm.available_block_num(),
           usage=rm.get_gpu_cache_usage_perc())

req = Request(request_id="r0", prompt_token_ids=[1] * 300, prompt_token_ids_len=300,
              sampling_params=SamplingParams(max_tokens=8), eos_token_ids=[0])
rm.add_request(req)
for f in req.async_process_futures:
    f.result()
batch, errors = rm.schedule()
out.update(scheduled=[t.request_id for t in batch.requests], errors=errors,
           held=rec.manager.request_pages("r0"), usage_after=rm.get_gpu_cache_usage_perc())
rm.finish_requests(["r0"])

# FastDeploy's own minimum for max_model_len is accepted...
fd_min = cc.max_block_num_per_seq + cc.enc_dec_block_num
cc.reset(fd_min)
rm.reset_cache_config(cc)
out["fd_min"] = fd_min
out["fd_min_pages"] = recycler_of(rm).num_pages
# ...and a count too small even for the pool is refused in FastDeploy's words (past FastDeploy's check)
from fastdeploy_paddlefleet.kvcache.pools import min_gpu_blocks
pool_min = min_gpu_blocks(recycler_of(rm).layout.pool, MML, BATCHED)
out["pool_min"] = pool_min
cc.total_block_num = cc.prefill_kvcache_block_num = pool_min - 1
try:
    rm.reset_cache_config(cc)
    out["too_small"] = None
except ValueError as e:
    out["too_small"] = str(e)
report(**out)
"""


@pytest.fixture(scope="module")
def host():
    return host_or_skip()


@pytest.mark.parametrize(("preset", "mml", "seqs", "batched"), CONFIGS)
def test_engine_starts_in_fastdeploys_order(host, tmp_path, preset, mml, seqs, batched):
    script = (
        f"PRESET = {preset!r}\nDIR = {str(tmp_path / 'model')!r}\nMML = {mml}\nSEQS = {seqs}\n"
        f"BATCHED = {batched}\n" + START
    )
    d = run_scenario(script, host=host, env=PLUGIN_ENV, timeout=300).check().data
    print(json.dumps(d, indent=1))
    assert d["architectures"][0] == "PaddleFleetForCausalLM"
    # FastDeploy's placeholder: the pool sized on it, nothing refused
    assert d["placeholder_recycler"] is True
    assert d["placeholder"] == (batched // seqs + 2) * seqs or d["placeholder"] > 0
    assert d["placeholder_pages"] == d["placeholder"] * d["pages_per_block"]
    # after profiling: one pool of every FastDeploy block's pages
    assert d["placeholder_after"] is False
    assert d["pages"] == d["profiled"] * d["pages_per_block"]
    assert d["free_blocks"] == d["profiled"] and d["usage"] == 0.0
    assert d["scheduled"] == ["r0"] and not d["errors"]
    assert sum(d["held"].values()) > 0 and d["usage_after"] > 0
    # FastDeploy's own minimum is never refused; below the pool's own minimum: FastDeploy's words
    assert d["fd_min_pages"] == d["fd_min"] * d["pages_per_block"]
    assert d["pool_min"] <= d["fd_min"]
    assert d["too_small"] is not None
    assert (
        f"current device block num: {d['pool_min'] - 1} should be larger than or equal to" in d["too_small"]
    )
    assert "please reduce the max_model_len" in d["too_small"]


V0 = """
import json, os
import fastdeploy
import fastdeploy.envs as fd_envs
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.resource_manager import ResourceManager
from fastdeploy_paddlefleet.presets import load_preset

os.makedirs(DIR, exist_ok=True)
with open(os.path.join(DIR, "config.json"), "w") as f:
    json.dump(dict(load_preset("gpt-oss-20b"), torch_dtype="bfloat16"), f)
cfg = EngineArgs(model=DIR, model_impl="paddlefleet", max_model_len=8192, max_num_seqs=16,
                 max_num_batched_tokens=2048, enable_chunked_prefill=True).create_engine_config()
out = {"v1": int(fd_envs.ENABLE_V1_KVCACHE_SCHEDULER)}
import fastdeploy.engine.sched.resource_manager_v1  # the plugin's hook is installed on this import
for mode in ("auto", "off"):
    os.environ["FDFLEET_KV_RECYCLE"] = mode
    try:
        ResourceManager(16, cfg, 1, "mixed", 0)
        out[mode] = None
    except ValueError as e:
        out[mode] = str(e)
report(**out)
"""


def test_v0_scheduler_is_refused_by_name(host, tmp_path):
    script = f"DIR = {str(tmp_path / 'model')!r}\n" + V0
    d = run_scenario(script, host=host, env=PLUGIN_ENV, timeout=300).check().data
    assert d["v1"] == 0  # FastDeploy's own choice on this platform: the V0 scheduler
    assert d["auto"] is not None and "ENABLE_V1_KVCACHE_SCHEDULER" in d["auto"], d
    assert "FDFLEET_KV_RECYCLE=off" in d["auto"]
    assert d["off"] is None
