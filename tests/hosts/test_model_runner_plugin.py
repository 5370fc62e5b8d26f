"""The model-runner plugin inside FastDeploy's REAL worker code (fresh child process per scenario).

* the entry point loads through FastDeploy's own ``load_model_runner_plugins`` when
  ``fastdeploy.worker.gpu_worker`` is imported; without ``FD_PLUGINS`` FastDeploy keeps its
  ``GPUModelRunner``, and with a second runner plugin selected FastDeploy's one-plugin assertion
  makes it keep its own as well;
* for a model that is not the plugin's (a Qwen2 config) the runner gives what FastDeploy's
  ``GPUModelRunner`` gives on the same config: block price, cache tensors and their IPC names,
  task insertion, forward metadata;
* for the plugin's model the block price is the per-layer sum computed here from the plan's fields
  (not FastDeploy's one inflated shape), FastDeploy's ``num_gpu_blocks = memory // price`` fits
  the memory, every layer's cache has its own shape, with recycling ONE pool (slot tensors whose
  pages any group takes, each layer a view of its slot: the layout both sides build, checked
  against a hand-built layout), and the page tables keep their device addresses while real
  ``insert_tasks_v1`` calls apply pickled deltas, clear preempted slots and refuse a task without
  a delta or from another layout; a model whose layers are all alike keeps FastDeploy's sizing.

Stand-ins for what a CPU machine lacks: ``_model_runner_host.py``.
"""

from __future__ import annotations

import json
import textwrap

import pytest
from _fastdeploy_host import host_or_skip, run_scenario
from _model_runner_host import RUNNER_PRELUDE

LOAD = r"""
import importlib.metadata as md
import os
import sys
import tempfile

if SECOND_PLUGIN:  # another distribution offering a runner in the same group
    root = tempfile.mkdtemp()
    dist = os.path.join(root, "other_runner-1.0.dist-info")
    os.makedirs(dist)
    meta = "Metadata-Version: 2.1\nName: other-runner\nVersion: 1.0\n"
    open(os.path.join(dist, "METADATA"), "w").write(meta)
    open(os.path.join(dist, "entry_points.txt"), "w").write(
        "[fastdeploy.model_runner_plugins]\nother = other_runner_mod:load\n"
    )
    open(os.path.join(root, "other_runner_mod.py"), "w").write("def load():\n    return object\n")
    sys.path.insert(0, root)

import fastdeploy.worker.gpu_worker as gw
from fastdeploy.worker.gpu_model_runner import GPUModelRunner

names = sorted(ep.name for ep in md.entry_points(group="fastdeploy.model_runner_plugins"))
out = {"group": names, "worker_runner": f"{gw.ModelRunner.__module__}.{gw.ModelRunner.__qualname__}"}
out["is_fastdeploys"] = gw.ModelRunner is GPUModelRunner
out["subclass"] = issubclass(gw.ModelRunner, GPUModelRunner)
if not SECOND_PLUGIN and os.environ.get("FD_PLUGINS"):
    from fastdeploy.plugins.model_runner import load_model_runner_plugins

    out["loader_gives_same_class"] = load_model_runner_plugins() is gw.ModelRunner
report(**out)
"""


@pytest.mark.parametrize(
    "plugins, second, ours",
    [("paddlefleet", False, True), (None, False, False), ("paddlefleet,other", True, False)],
    ids=["selected", "not-selected", "two-runner-plugins"],
)
def test_entry_point_loads_through_fastdeploys_loader(plugins, second, ours):
    host = host_or_skip()
    script = f"SECOND_PLUGIN = {second}\n" + textwrap.dedent(RUNNER_PRELUDE) + textwrap.dedent(LOAD)
    env = {"FD_PLUGINS": plugins} if plugins else {}
    d = run_scenario(script, host=host, env=env).check().data
    assert "paddlefleet" in d["group"], d
    assert d["is_fastdeploys"] is (not ours), d
    if ours:
        assert d["subclass"] and d["worker_runner"].startswith("fastdeploy_paddlefleet.serving.model_runner")
        assert d["loader_gives_same_class"]
    if second:
        assert d["group"] == ["other", "paddlefleet"]  # both offered; FastDeploy's assert picks neither


FOREIGN = r"""
import pickle

import fastdeploy.worker.gpu_worker as gw
from fastdeploy.engine.request import BatchRequest, Request, RequestType
from fastdeploy.engine.sampling_params import SamplingParams
from fastdeploy.worker.gpu_model_runner import GPUModelRunner

assert gw.ModelRunner is not GPUModelRunner
cfg = make_config(MODEL_DIR, max_model_len=64, block_size=4, max_num_seqs=4)
out = {"architectures": list(cfg.model_config.architectures)}
params = SamplingParams(
    top_p=1.0, top_k=0, min_p=0.0, temperature=1.0, repetition_penalty=1.0, frequency_penalty=0.0,
    presence_penalty=0.0, max_tokens=16, min_tokens=1,
)
for label, cls in (("fastdeploy", GPUModelRunner), ("plugin", gw.ModelRunner)):
    IPC.clear()
    runner = make_runner(cls, cfg)
    r = {"fleet": getattr(runner, "fleet", None) is not None, "price": runner.cal_theortical_kvcache()}
    runner.num_gpu_blocks = 10
    runner.initialize_kv_cache()
    r["caches"] = [list(t.shape) for t in runner.share_inputs["caches"]]
    r["ipc"] = dict(IPC)
    req = Request(
        "a", prompt_token_ids=list(range(3, 13)), eos_token_ids=[2] * cfg.model_config.eos_tokens_lens,
        sampling_params=params, prefill_start_index=0, prefill_end_index=8,
    )
    req.idx, req.task_type, req.block_tables, req.output_token_ids = 1, RequestType.PREFILL, [4, 7], []
    batch = BatchRequest()
    batch.add_request(pickle.loads(pickle.dumps(req)))
    runner.insert_tasks_v1(batch, 2)
    runner._dummy_prefill_inputs([5, 3], [2, 2], 2)
    runner.initialize_forward_meta()
    fm = runner.forward_meta
    r["block_tables"] = fm.block_tables.numpy().tolist()
    r["seq_lens_encoder"] = runner.share_inputs["seq_lens_encoder"].numpy().ravel().tolist()
    r["headwise"] = getattr(fm, "block_tables_headwise", None) is not None
    out[label] = r
report(**out)
"""


def test_foreign_model_gets_fastdeploys_behaviour(tmp_path):
    host = host_or_skip()
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    script = (
        f"MODEL_DIR = {json.dumps(str(tmp_path))}\n"
        + textwrap.dedent(RUNNER_PRELUDE)
        + textwrap.dedent(FOREIGN)
    )
    d = run_scenario(script, host=host, env={"FD_PLUGINS": "paddlefleet"}).check().data
    assert d["architectures"] == ["Qwen2ForCausalLM"]
    fd, ours = d["fastdeploy"], d["plugin"]
    assert not ours["fleet"] and not ours["headwise"]
    for key in ("price", "caches", "ipc", "block_tables", "seq_lens_encoder"):
        assert ours[key] == fd[key], (key, ours[key], fd[key])
    assert fd["caches"] == [[10, 2, 4, 16]] * 6  # FastDeploy's one shape, 3 layers x (K, V)


OURS = r"""
import pickle

import fastdeploy.worker.gpu_worker as gw
from fastdeploy.engine.request import BatchRequest, Request, RequestType
from fastdeploy.engine.sampling_params import SamplingParams
from fastdeploy.worker.gpu_model_runner import GPUModelRunner

from fastdeploy_paddlefleet.serving.kv_recycling.protocol import TASK_ATTR, KVDelta

cfg = make_config(MODEL_DIR, model_impl="paddlefleet", max_model_len=64, block_size=4, max_num_seqs=4)
runner = make_runner(gw.ModelRunner, cfg)
runner.load_model()
out = {"fleet": runner.fleet is not None, "dtype": str(cfg.model_config.dtype)}
out["max_num_batched_tokens"] = cfg.scheduler_config.max_num_batched_tokens
out["price"] = runner.cal_theortical_kvcache()
out["fastdeploy_price"] = GPUModelRunner.cal_theortical_kvcache(runner)
# FastDeploy's profile_run: caches of total_block_num blocks for every layer, a dummy run, cleared
runner.num_gpu_blocks = 7
runner.initialize_kv_cache(profile=True)
out["profile_caches"] = [list(t.shape) for t in runner.share_inputs["caches"]]
runner._dummy_prefill_inputs([5, 3], [2, 2], 2)
runner.initialize_forward_meta(is_dummy_or_profile_run=True)
out["profile_headwise"] = getattr(runner.forward_meta, "block_tables_headwise", None) is not None
runner.clear_cache(profile=True)
runner.num_gpu_blocks = MEMORY // out["price"]  # worker_process.initialize_kv_cache
out["num_gpu_blocks"] = runner.num_gpu_blocks
runner.initialize_kv_cache()
caches = runner.share_inputs["caches"]
out["caches"] = [list(t.shape) for t in caches]
out["cache_bytes"] = sum(int(np.prod(t.shape)) * t.element_size() for t in caches)
out["ipc"] = dict(IPC)
out["recycling"] = runner.fleet is not None and runner.fleet.tables is not None
if out["recycling"]:
    fleet = runner.fleet
    out["layout"] = fleet.layout.to_dict()
    out["pool"] = fleet.pool.to_dict()
    out["num_pages"] = fleet.num_pages
    # every layer's K / V is a view of its slot's tensor (same memory): a write through the view of
    # layer 0 at page 3 lands in row 3 of slot 0's key tensor
    slots = {name: t for name, t in runner.cache_kvs_map.items()}
    out["slot_names"] = sorted(slots)
    k0 = caches[0]
    g0 = fleet.layout.pool.heads_per_page
    before = float(slots[f"key_caches_slot0_rank0.device0"].sum())
    k0[3 * g0 // k0.shape[1], (3 * g0) % k0.shape[1], 0, 0] = 1.0
    out["view_write_lands"] = float(slots[f"key_caches_slot0_rank0.device0"][3].sum()) - before
    k0[3 * g0 // k0.shape[1], (3 * g0) % k0.shape[1], 0, 0] = 0.0
    tables = fleet.tables
    ptrs = [t.data_ptr() for t in tables.tables]
    params = SamplingParams(
        top_p=1.0, top_k=0, min_p=0.0, temperature=1.0, repetition_penalty=1.0, frequency_penalty=0.0,
        presence_penalty=0.0, max_tokens=16, min_tokens=1,
    )

    def task(rid, slot, kind, delta=None):
        t = Request(
            rid, prompt_token_ids=list(range(3, 23)), eos_token_ids=[2] * cfg.model_config.eos_tokens_lens,
            sampling_params=params, prefill_start_index=0, prefill_end_index=12,
        )
        t.idx, t.task_type, t.block_tables, t.output_token_ids = slot, kind, [0, 1, 2], []
        if delta is not None:
            setattr(t, TASK_ATTR, delta)
        return pickle.loads(pickle.dumps(t))

    def send(*tasks):
        batch = BatchRequest()
        for t in tasks:
            batch.add_request(t)
        runner.insert_tasks_v1(batch, 4)

    lid = fleet.layout.layout_id
    groups = fleet.layout.groups
    # request a in slot 1: 3 blocks; request b in slot 2: 2 blocks; lane entries per group
    def changes(base, n):
        ch = []
        for g in groups:
            for lane in range(len(g.lanes)):
                for b in range(n):
                    ch.append((g.index, lane, b, base + 10 * lane + b))
        return tuple(ch)

    send(task("a", 1, RequestType.PREFILL, KVDelta("a", 1, True, 3, changes(0, 3), lid)),
         task("b", 2, RequestType.PREFILL, KVDelta("b", 1, True, 2, changes(5, 2), lid)))
    # a: block 0 of every lane released; b is preempted
    release = tuple((g.index, lane, 0, -1) for g in groups for lane in range(len(g.lanes)))
    send(task("a", 1, RequestType.DECODE, KVDelta("a", 2, False, 3, release, lid)),
         task("b", 2, RequestType.PREEMPTED))
    # delivered twice: skipped
    send(task("a", 1, RequestType.DECODE, KVDelta("a", 2, False, 3, release, lid)))
    out["tables"] = [tables.host_table(g.index)[: 4 * g.num_kv_heads, :4].tolist() for g in groups]
    out["device_equals_host"] = all(
        (tables.tables[g.index].numpy() == tables.host_table(g.index)).all() for g in groups
    )
    out["kept_addresses"] = [t.data_ptr() for t in tables.tables] == ptrs
    runner.initialize_forward_meta()
    fm = runner.forward_meta
    out["forward_layers"] = sorted(fm.block_tables_headwise)
    out["forward_shares_memory"] = all(
        fm.block_tables_headwise[li].data_ptr() == ptrs[g.index] for g in groups for li in g.layers
    )
    out["forward_rows"] = {str(li): list(t.shape) for li, t in fm.block_tables_headwise.items()}
    # a dummy run after the pools exist (CUDA-graph capture): valid pages of every pool, never -1
    runner._dummy_prefill_inputs([5, 3], [2, 2], 2)
    out["dummy_rows"] = [tables.host_table(g.index)[: 2 * g.num_kv_heads, :3].tolist() for g in groups]
    out["dummy_pages"] = fleet.num_pages
    for label, bad in (
        ("missing", task("c", 3, RequestType.PREFILL)),
        ("layout", task("c", 3, RequestType.PREFILL, KVDelta("c", 1, True, 1, (), "another"))),
        ("lost", task("a", 1, RequestType.DECODE, KVDelta("a", 4, False, 3, (), lid))),
    ):
        try:
            send(bad)
            out[f"refused_{label}"] = None
        except ValueError as e:
            out[f"refused_{label}"] = str(e)
report(**out)
"""


@pytest.fixture(scope="module")
def fleet_dirs(tmp_path_factory):
    from fastdeploy_paddlefleet.presets import load_preset
    from fastdeploy_paddlefleet.serving.modeldir import write_model_dir

    uniform = load_preset("tiny")  # every layer 2 kv heads of 16 channels, windows kept
    uniform.update(swa_v_head_dim=16, swa_head_dim=16, swa_num_key_value_heads=2, v_head_dim=16)
    root = tmp_path_factory.mktemp("fleetrunner")
    return {
        name: str(write_model_dir(preset, root / name, dtype="float32", seed=0))
        for name, preset in (("tiny", "tiny"), ("tiny-mimo", "tiny-mimo"), ("uniform", uniform))
    }


def _independent_price(model_dir: str, block_size: int, nbytes: int) -> tuple[int, list]:
    """One block over every layer, from the plan's fields: bs * sum Hkv * (qk + v) * bytes."""
    from fastdeploy_paddlefleet.plan import plan_from_config

    plan = plan_from_config(model_dir)
    layers = [(la.index, la.num_kv_heads, la.qk_head_dim, la.v_head_dim) for la in plan]
    return block_size * sum(h * (qk + v) for _, h, qk, v in layers) * nbytes, layers


def _run_ours(fleet_dirs, name, recycle, memory=300_000):
    host = host_or_skip()
    pytest.importorskip("safetensors")
    script = (
        f"MODEL_DIR = {json.dumps(fleet_dirs[name])}\nMEMORY = {memory}\n"
        + textwrap.dedent(RUNNER_PRELUDE)
        + textwrap.dedent(OURS)
    )
    env = {"FD_PLUGINS": "paddlefleet", "FDFLEET_KV_RECYCLE": recycle, "FDFLEET_BACKEND": "reference"}
    return run_scenario(script, host=host, env=env).check().data


@pytest.mark.parametrize("name", ["tiny", "tiny-mimo"])
def test_per_layer_caches_and_price_without_recycling(fleet_dirs, name):
    d = _run_ours(fleet_dirs, name, "off")
    price, layers = _independent_price(fleet_dirs[name], 4, 4)  # float32 caches
    assert d["fleet"] and not d["recycling"] and d["dtype"] == "float32"
    assert d["price"] == price
    assert d["fastdeploy_price"] != price  # FastDeploy's one inflated shape (and its 2-byte rule)
    n = 300_000 // price
    assert d["num_gpu_blocks"] == n and d["cache_bytes"] == n * price <= 300_000
    want = []
    for index, h, qk, v in layers:
        want += [[n, h, 4, qk], [n, h, 4, v]]
        assert d["ipc"][f"key_caches_{index}_rank0.device0"] == [n, h, 4, qk]
        assert d["ipc"][f"value_caches_{index}_rank0.device0"] == [n, h, 4, v]
    assert d["caches"] == want


def _expected_rows(group: dict, slot_lanes: dict[int, list[list[int]]]) -> list[list[int]]:
    """Kernel rows of slots 0..3 from lane entries: lane ``j`` holds kv heads ``[j * unit, (j + 1) *
    unit)``, its page ``u`` is entry ``u * unit + h % unit`` on head ``h``'s row."""
    h, unit = group["num_kv_heads"], group["unit"]
    rows = [[-1] * 4 for _ in range(4 * h)]
    for slot, lanes in slot_lanes.items():
        for head in range(h):
            for b, u in enumerate(lanes[head // unit]):
                rows[slot * h + head][b] = u * unit + head % unit if u >= 0 else -1
    return rows


def _independent_pool(model_dir: str, block_size: int, nbytes: int) -> tuple[int, int, dict]:
    """The one pool by hand: layers grouped by (kv heads, windows), groups cut to the gcd of their
    sizes, pages of the gcd of the kv heads per lane (1 where a layer mixes full and sliding heads),
    slots as wide as the widest head dims. Returns (price of a FastDeploy block, pages per block,
    {layer: (kv heads, lanes)})."""
    import math

    from fastdeploy_paddlefleet.plan import plan_from_config

    plan = plan_from_config(model_dir)
    kinds: dict = {}
    for la in plan:
        windows = tuple(la.head_window(h) for h in range(la.num_kv_heads))
        kinds.setdefault((la.num_kv_heads, windows), []).append(la.index)
    slots = math.gcd(*[len(v) for v in kinds.values()])
    per_lane = [1 if len(set(w)) > 1 else h for h, w in kinds]
    heads = math.gcd(*per_lane)
    lanes = {li: (h, h // heads if len(set(w)) == 1 else h) for (h, w), v in kinds.items() for li in v}
    pages_per_block = sum(len(v) // slots * lanes[v[0]][1] for v in kinds.values())
    dk, dv = max(la.qk_head_dim for la in plan), max(la.v_head_dim for la in plan)
    page = slots * heads * block_size * (dk + dv) * nbytes
    return pages_per_block * page, pages_per_block, lanes


@pytest.mark.parametrize("name", ["tiny", "tiny-mimo"])
def test_recycling_one_pool_and_page_tables_at_fixed_addresses(fleet_dirs, name):
    from fastdeploy_paddlefleet.plan import plan_from_config

    d = _run_ours(fleet_dirs, name, "auto")
    price, pages_per_block, lanes = _independent_pool(fleet_dirs[name], 4, 4)
    assert d["recycling"] and d["price"] == price
    n = d["num_gpu_blocks"]
    assert n == 300_000 // price
    pages = n * pages_per_block
    assert d["num_pages"] == pages
    pool = d["pool"]
    rows = pool["rows"]
    assert pages <= rows < pages + max(h // pool["key_shape"][1] for h, _ in lanes.values())
    assert d["slot_names"] == sorted(
        f"{role}_caches_slot{t}_rank0.device0" for role in ("key", "value") for t in range(pool["slots"])
    )
    # each layer: a view [rows * G / Hkv, Hkv, block, own dims] of its slot's [rows, G, block, widest dims]
    g = pool["key_shape"][1]
    want = []
    for la in plan_from_config(fleet_dirs[name]):
        want += [
            [rows * g // la.num_kv_heads, la.num_kv_heads, 4, dim] for dim in (la.qk_head_dim, la.v_head_dim)
        ]
    assert d["caches"] == want
    assert d["view_write_lands"] == 1.0
    # tables: a (slot 1) holds 3 blocks with block 0 released, b (slot 2) was preempted
    for group, rows_g in zip(d["layout"]["groups"], d["tables"], strict=True):
        a = [[-1] + [10 * lane + b for b in (1, 2)] for lane in range(len(group["lanes"]))]
        assert rows_g == _expected_rows(group, {1: a}), (group, rows_g)
    assert d["device_equals_host"] and d["kept_addresses"] and d["forward_shares_memory"]
    assert d["forward_layers"] == sorted(lanes)
    for group in d["layout"]["groups"]:
        for li in group["layers"]:
            assert d["forward_rows"][str(li)] == [4 * group["num_kv_heads"], 18]  # FastDeploy's width
    for group, rows_g in zip(d["layout"]["groups"], d["dummy_rows"], strict=True):
        limit = d["dummy_pages"] * group["unit"]  # entries index the layer's view: pages * G heads
        assert all(0 <= p < limit for row in rows_g for p in row[:2]) and all(row[2] == -1 for row in rows_g)
    assert not d["profile_headwise"]  # profile run: FastDeploy's block_tables, the pool not built yet
    assert d["profile_caches"] == [
        [7, la.num_kv_heads, 4, dim]
        for la in plan_from_config(fleet_dirs[name])
        for dim in (la.qk_head_dim, la.v_head_dim)
    ]
    assert "fdfleet_kv_delta" in d["refused_missing"]
    assert "layout_id='another'" in d["refused_layout"]
    assert "seq=4, expected 3" in d["refused_lost"]


def test_model_with_alike_layers_keeps_fastdeploys_sizing(fleet_dirs):
    d = _run_ours(fleet_dirs, "uniform", "off")
    assert d["fleet"] and not d["recycling"]
    assert d["price"] == d["fastdeploy_price"]  # FastDeploy's own rule, deferred to
    n = d["num_gpu_blocks"]
    assert d["caches"] == [[n, 2, 4, 16]] * 10  # FastDeploy's get_kv_cache_shape for every layer


SHARED = r"""
import fastdeploy.worker.gpu_worker as gw
from fastdeploy.worker.gpu_model_runner import GPUModelRunner

cfg = make_config(MODEL_DIR, model_impl="paddlefleet", max_model_len=64, block_size=4, max_num_seqs=4)
cfg.cache_config.num_cpu_blocks = 8  # what swap_space gives: FastDeploy's transfer manager swaps by name
runner = make_runner(gw.ModelRunner, cfg)
runner.load_model()
out = {"fleet": runner.fleet is not None, "price": runner.cal_theortical_kvcache()}
out["fastdeploy_price"] = GPUModelRunner.cal_theortical_kvcache(runner)
runner.num_gpu_blocks = 10
runner.initialize_kv_cache()
out["caches"] = [list(t.shape) for t in runner.share_inputs["caches"]]
report(**out)
"""


def test_caches_shared_with_another_process_keep_fastdeploys_shape(fleet_dirs):
    """CPU swap (and PD / KV storage) attach the caches by name with FastDeploy's single shape in
    another process: the runner keeps FastDeploy's sizing there (one WARNING naming the setting)."""
    host = host_or_skip()
    pytest.importorskip("safetensors")
    script = f"MODEL_DIR = {json.dumps(fleet_dirs['tiny'])}\n" + textwrap.dedent(RUNNER_PRELUDE)
    script += textwrap.dedent(SHARED)
    env = {"FD_PLUGINS": "paddlefleet", "FDFLEET_KV_RECYCLE": "off", "FDFLEET_BACKEND": "reference"}
    result = run_scenario(script, host=host, env=env).check()
    d = result.data
    assert not d["fleet"] and d["price"] == d["fastdeploy_price"]
    assert d["caches"] == [[10, 2, 4, 16]] * 10  # tiny's largest layer, every layer
    assert "num_cpu_blocks=8 (swap_space)" in result.stdout + result.stderr
