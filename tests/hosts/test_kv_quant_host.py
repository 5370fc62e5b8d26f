"""Quantized KV caches (issue 31) inside FastDeploy's REAL code (fresh child process per scenario).

With ``kv_cache_quant_type=block_wise_fp8`` (FastDeploy's own ``--quantization`` JSON, parsed by its
own ``parse_quant_config`` into a ``MixQuantConfig`` with only a KV type):

* FastDeploy's ``GPUModelRunner.initialize_kv_cache`` allocates ``[k, v, k_scales, v_scales]`` per
  layer (uint8 codes in its one shape, scales ``[num_blocks, kv_heads, block_size]``); the plugin's
  cache views accept that list and give each layer a ``QuantizedKVCache`` of its heads and dims;
  FastDeploy's own ``cal_theortical_kvcache`` is one byte per element and leaves the scales out
  (its block count over-commits: checked against the bytes it allocates);
* the plugin's runner allocates each layer's own codes and scales (and, with window recycling, the
  one pool's slot codes and scales), prices a block with the scales, so ``num_gpu_blocks * price``
  equals the bytes allocated, and its cache list passes the same views;
* FastDeploy's scheduler with the recycling hook keeps its invariants on a quantized model
  (the scheduler-trace harness, ``_scheduler_sim.py``).

A forward on the quantized cache tracks the unquantized one (reference backend, loosely);
``test_kv_quant_forward.py`` holds the Triton backend to the reference on the same quantized cache.
"""

from __future__ import annotations

import inspect
import json
import textwrap

import pytest
from _fastdeploy_host import host_or_skip, run_scenario
from _model_runner_host import RUNNER_PRELUDE

QUANT = {"quantization": "mix_quant", "kv_cache_quant_type": "block_wise_fp8"}


@pytest.fixture(scope="module")
def quant_dirs(tmp_path_factory):
    from fastdeploy_paddlefleet.serving.modeldir import write_model_dir

    root = tmp_path_factory.mktemp("kvquant")
    return {
        name: str(write_model_dir(name, root / name, dtype="float32", seed=3))
        for name in ("tiny", "tiny-mimo")
    }


def _plan_rows(model_dir: str) -> list[tuple[int, int, int, int]]:
    from fastdeploy_paddlefleet.plan import plan_from_config

    return [(la.index, la.num_kv_heads, la.qk_head_dim, la.v_head_dim) for la in plan_from_config(model_dir)]


SETUP = r"""
import json
from types import SimpleNamespace

from fastdeploy.model_executor.layers.quantization import parse_quant_config

from fastdeploy_paddlefleet.kvcache.quant import FORMATS
from fastdeploy_paddlefleet.plan import plan_from_config
from fastdeploy_paddlefleet.serving.forward_meta import layer_caches


def quant_config(model_dir, runner_cls=None, **kw):
    cfg = make_config(model_dir, model_impl="paddlefleet", max_model_len=64, block_size=4, max_num_seqs=4,
                      quantization=dict(QUANT), **kw)
    args = SimpleNamespace(quantization=dict(QUANT), dynamic_load_weight=False, tensor_parallel_size=1)
    cfg.quant_config = parse_quant_config(args, cfg.model_config, is_ernie=False, is_v1_loader=True)
    return cfg


def describe(caches):
    return [[list(t.shape), str(t.dtype).rsplit(".", 1)[-1]] for t in caches]


def nbytes(caches):
    seen, total = set(), 0
    for t in caches:  # views of one slot tensor count once (by their base's address)
        key = (t.data_ptr(), int(np.prod(t.shape)))
        if key not in seen:
            seen.add(key)
            total += int(np.prod(t.shape)) * t.element_size()
    return total


def views(caches, plan):
    out = []
    for q in layer_caches(caches, plan, FORMATS["block_wise_fp8"]):
        shapes = [list(t.shape) for t in (q.key, q.value, q.key_scale, q.value_scale)]
        out.append(shapes + [str(q.key.dtype).rsplit(".", 1)[-1], str(q.key_scale.dtype).rsplit(".", 1)[-1]])
    return out
"""

FASTDEPLOY_ALLOC = r"""
from fastdeploy.worker.gpu_model_runner import GPUModelRunner

cfg = quant_config(MODEL_DIR)
out = {"quant_config": type(cfg.quant_config).__name__, "kv_type": str(cfg.quant_config.kv_cache_quant_type)}
out["cache_dtype"] = cfg.cache_config.cache_dtype
runner = make_runner(GPUModelRunner, cfg)
out["fastdeploy_price"] = runner.cal_theortical_kvcache()
runner.num_gpu_blocks = 10
runner.initialize_kv_cache()
caches = runner.share_inputs["caches"]
out["caches"] = describe(caches)
out["cache_bytes"] = nbytes(caches)
out["ipc"] = sorted(IPC)
out["views"] = views(caches, plan_from_config(MODEL_DIR))
out["uniform"] = [cfg.model_config.num_key_value_heads, cfg.model_config.head_dim]
report(**out)
"""


def test_fastdeploys_own_block_wise_fp8_allocation_is_viewed_per_layer(quant_dirs):
    host = host_or_skip()
    pytest.importorskip("safetensors")
    model_dir = quant_dirs["tiny-mimo"]
    script = (
        f"MODEL_DIR = {json.dumps(model_dir)}\nQUANT = {QUANT!r}\n"
        + textwrap.dedent(RUNNER_PRELUDE)
        + textwrap.dedent(SETUP)
        + textwrap.dedent(FASTDEPLOY_ALLOC)
    )
    d = run_scenario(script, host=host, env={"FD_PLUGINS": "paddlefleet"}).check().data
    assert d["quant_config"] == "MixQuantConfig" and d["kv_type"].endswith("block_wise_fp8"), d
    h, dim = d["uniform"]
    rows = _plan_rows(model_dir)
    n, bs = 10, 4
    # FastDeploy: [k, v, k_scales, v_scales] per layer, uint8 codes in its one shape, float32 scales
    assert d["caches"] == sum(
        ([[[n, h, bs, dim], "uint8"]] * 2 + [[[n, h, bs], "float32"]] * 2 for _ in rows), []
    )
    # FastDeploy's own price: one byte per element, no scales; what it allocates has them
    layers = len(rows)
    assert d["fastdeploy_price"] == 1 * 2 * bs * h * dim * layers
    allocated = n * layers * (2 * h * bs * dim + 2 * h * bs * 4)
    assert d["cache_bytes"] == allocated > n * d["fastdeploy_price"]
    # our views: each layer's heads and dims, scales matching the codes' first three dims
    assert d["views"] == [
        [[n, hk, bs, qk], [n, hk, bs, v], [n, hk, bs], [n, hk, bs], "uint8", "float32"]
        for _, hk, qk, v in rows
    ]


OURS_ALLOC = r"""
import fastdeploy.worker.gpu_worker as gw
from fastdeploy.worker.gpu_model_runner import GPUModelRunner

cfg = quant_config(MODEL_DIR)
runner = make_runner(gw.ModelRunner, cfg)
runner.load_model()
out = {"fleet": runner.fleet is not None, "quant": runner.fleet.quant.name}
out["price"] = runner.cal_theortical_kvcache()
out["fastdeploy_price"] = GPUModelRunner.cal_theortical_kvcache(runner)
runner.num_gpu_blocks = 7
runner.initialize_kv_cache(profile=True)
out["profile_caches"] = describe(runner.share_inputs["caches"])
runner.clear_cache(profile=True)
runner.num_gpu_blocks = MEMORY // out["price"]
out["num_gpu_blocks"] = runner.num_gpu_blocks
runner.initialize_kv_cache()
caches = runner.share_inputs["caches"]
out["caches"] = describe(caches)
out["cache_bytes"] = sum(int(np.prod(t.shape)) * t.element_size() for t in runner.cache_kvs_map.values())
out["recycling"] = runner.fleet.tables is not None
out["num_pages"] = runner.fleet.num_pages
out["rows"] = None if runner.fleet.pool is None else runner.fleet.pool.rows
out["pages_per_block"] = None if runner.fleet.layout is None else runner.fleet.layout.pool.pages_per_block
out["views"] = views(caches, runner.model.plan)
out["model_quant"] = runner.model.kv_quant.name
report(**out)
"""


@pytest.mark.parametrize("recycle", ["off", "auto"])
@pytest.mark.parametrize("name", ["tiny", "tiny-mimo"])
def test_runner_hook_allocates_codes_and_scales_priced_honestly(quant_dirs, name, recycle):
    host = host_or_skip()
    pytest.importorskip("safetensors")
    model_dir, memory = quant_dirs[name], 300_000
    script = (
        f"MODEL_DIR = {json.dumps(model_dir)}\nQUANT = {QUANT!r}\nMEMORY = {memory}\n"
        + textwrap.dedent(RUNNER_PRELUDE)
        + textwrap.dedent(SETUP)
        + textwrap.dedent(OURS_ALLOC)
    )
    env = {"FD_PLUGINS": "paddlefleet", "FDFLEET_KV_RECYCLE": recycle, "FDFLEET_BACKEND": "reference"}
    d = run_scenario(script, host=host, env=env).check().data
    rows = _plan_rows(model_dir)
    bs, scale = 4, 4  # float32 model: 4-byte scales
    # independent price: per layer and token Hkv * (qk + v) code bytes + 2 * Hkv scales
    price = bs * sum(h * (qk + v) + 2 * h * scale for _, h, qk, v in rows)
    assert d["fleet"] and d["quant"] == d["model_quant"] == "block_wise_fp8"
    n = memory // d["price"]
    assert d["num_gpu_blocks"] == n
    if not d["recycling"]:
        assert d["price"] == price
        assert d["cache_bytes"] == n * price <= memory
        want = []
        for _, h, qk, v in rows:
            want += [[[n, h, bs, qk], "uint8"], [[n, h, bs, v], "uint8"], [[n, h, bs], "float32"]]
            want += [[[n, h, bs], "float32"]]
        assert d["caches"] == want
    else:
        assert d["price"] >= price  # the pool pays for padding between head dims, never less
        assert d["num_pages"] == n * d["pages_per_block"] <= d["rows"]
        # what is allocated: the priced pages, plus the rounding of rows to the layout's multiple
        assert d["cache_bytes"] == d["rows"] * d["price"] // d["pages_per_block"]
        assert d["cache_bytes"] <= memory + (d["rows"] - d["num_pages"]) * d["price"] // d["pages_per_block"]
    # every layer's view: its own heads and dims, scales matching the codes
    assert [v[0][1:] for v in d["views"]] == [[h, bs, qk] for _, h, qk, _ in rows]
    assert [v[1][1:] for v in d["views"]] == [[h, bs, vd] for _, h, _, vd in rows]
    assert all(v[2] == v[0][:3] == v[3] and v[4:] == ["uint8", "float32"] for v in d["views"])


TRACE = """
import json, os
from fastdeploy.model_executor.layers.quantization import parse_quant_config

runs = []
for nb in (30, 48):
    cfg = make_config(TINY, max_model_len=512, max_num_seqs=16, max_num_batched_tokens=128, block_size=16,
                      num_blocks=nb)
    for lag in (0, 3):
        rm = make_manager(cfg)
        sim = Sim(rm, lag)
        trace = make_trace(7 * nb + lag, 40, (4, 300), (1, 150), 2, aborts=0.1)
        st = sim.run(trace, 20000)
        runs.append(dict(blocks=nb, lag=lag, steps=st.steps, checks=st.checks, finished=st.finished,
                         aborted=st.aborted, requests=len(trace.arrivals), all_free=sim.all_free(),
                         left=len(rm.requests), cache_dtype=cfg.cache_config.cache_dtype,
                         released=sim.worker.released))
report(runs=runs)
"""


def test_scheduler_traces_on_a_block_wise_fp8_model(tmp_path):
    """The scheduler-trace harness on a checkpoint whose config.json quantizes only the KV cache."""
    host = host_or_skip()
    from fastdeploy_paddlefleet.serving.modeldir import write_model_dir

    model_dir = write_model_dir("tiny", tmp_path / "tiny", dtype="float32", seed=5)
    raw = json.loads((model_dir / "config.json").read_text())
    raw["quantization_config"] = dict(QUANT)
    (model_dir / "config.json").write_text(json.dumps(raw))
    script = f"TINY = {str(model_dir)!r}\nimport fastdeploy\nfrom _scheduler_sim import *\n" + TRACE
    env = {"FD_PLUGINS": "paddlefleet", "FDFLEET_KV_RECYCLE": "auto"}
    runs = run_scenario(script, host=host, env=env, timeout=600).check().data["runs"]
    for r in runs:
        assert r["cache_dtype"] == "block_wise_fp8", r  # FastDeploy read the checkpoint's KV type
        assert r["all_free"] and r["left"] == 0 and r["checks"] == r["steps"], r
        assert r["finished"] + r["aborted"] == r["requests"], r
    assert sum(r["released"] for r in runs) > 0


def reference_has_quantized_path() -> bool:
    from fastdeploy_paddlefleet.backends import reference

    return "QuantizedKVCache" in inspect.getsource(reference)


FORWARD = r"""
import fastdeploy.worker.gpu_worker as gw

outs = {}
for label, quantized in (("bf16", False), ("fp8", True)):
    cfg = quant_config(MODEL_DIR) if quantized else make_config(
        MODEL_DIR, model_impl="paddlefleet", max_model_len=64, block_size=4, max_num_seqs=4)
    IPC.clear()
    runner = make_runner(gw.ModelRunner, cfg)
    runner.load_model()
    runner.num_gpu_blocks = 16
    runner.initialize_kv_cache()
    si = runner.share_inputs
    si["block_tables"][:] = -1
    si["block_tables"][0, :3] = paddle.to_tensor(np.array([2, 5, 7], "int32"))
    ids = fill_step_inputs(runner, [9, 0, 0, 0], [9, 0, 0, 0], [0, 0, 0, 0], list(range(3, 12)))
    runner.initialize_forward_meta()
    hidden = runner.model(si, runner.forward_meta)
    outs[label] = hidden.astype("float32").numpy().tolist()
report(**outs)
"""


def test_forward_on_a_block_wise_fp8_cache_tracks_the_unquantized_one(quant_dirs):
    if not reference_has_quantized_path():
        pytest.skip(
            "reference backend has no quantized path yet (backends/reference.py takes no QuantizedKVCache)"
        )
    host = host_or_skip()
    pytest.importorskip("safetensors")
    script = (
        f"MODEL_DIR = {json.dumps(quant_dirs['tiny'])}\nQUANT = {QUANT!r}\n"
        + textwrap.dedent(RUNNER_PRELUDE)
        + textwrap.dedent(SETUP)
        + textwrap.dedent(FORWARD)
    )
    env = {"FD_PLUGINS": "paddlefleet", "FDFLEET_KV_RECYCLE": "off", "FDFLEET_BACKEND": "reference"}
    d = run_scenario(script, host=host, env=env).check().data
    import numpy as np

    ref, fp8 = np.asarray(d["bf16"]), np.asarray(d["fp8"])
    assert ref.shape == fp8.shape and np.isfinite(fp8).all()
    # e4m3 keeps 3 mantissa bits: per-element error up to 1/16 of each token-head's max, diluted by
    # attention; the hidden states stay close to the unquantized forward
    assert np.abs(fp8 - ref).max() <= 0.1 * max(1.0, np.abs(ref).max())
