"""Forwards on a ``block_wise_fp8`` KV cache inside FastDeploy's REAL runner: Triton = reference.

Issue 31, done-when 5. In a fresh child process per scenario (``_fastdeploy_host.run_scenario``,
``FD_PLUGINS=paddlefleet``, the stand-ins of ``_model_runner_host``), FastDeploy parses
``kv_cache_quant_type=block_wise_fp8`` with its own ``parse_quant_config`` and builds TWO runners of the
same checkpoint, one per attention backend (``FDFLEET_BACKEND=reference`` / ``triton``, the kernels
interpreted on CPU). Each allocates its caches through FastDeploy's flow (``num_gpu_blocks``, then
``initialize_kv_cache``); every code starts as the NaN byte ``0x7F`` and every scale as NaN, so a read
of a slot never written shows as a non-finite output. The same steps, with FastDeploy's real
``ForwardMeta`` (``initialize_forward_meta``), run through both models as the runner calls them:

* ``fastdeploy``: FastDeploy's own ``GPUModelRunner.initialize_kv_cache`` (its one shape for every
  layer, ``[k, v, k_scales, v_scales]`` per layer; ``tiny``'s layers see views of their heads and
  dims): a prefill, a chunked prefill, a request joining, mixed prefill + decode, decode;
* ``recycling``: the plugin's runner with window recycling on (``FDFLEET_KV_RECYCLE=auto``, the one
  pool's slot codes and scales): a trace whose pages the head-wise manager releases as requests pass
  their windows, NaN-poisons (codes ``0x7F``, scales NaN) and gives to later requests, the table
  changes travelling as ``KVDelta`` tasks through the runners' real ``insert_tasks_v1``.

The reference backend is the oracle (its quantized write is checked bit-exact against FastDeploy's
rule in ``test_kv_quant_rule.py``). After every step:

* hidden states and logits of the Triton run equal the reference run's within 1e-4 (fp32);
* the cache bytes the two wrote are the same: layer 0 (whose K / V both backends get bit-identical)
  byte-identical, codes and scales alike; deeper layers' inputs differ by the attention's own
  rounding (~1e-7), so a code may land on the adjacent e4m3 value and a scale differ in its last
  bits: at most 0.5 % of the codes, each one step apart, scales within 1e-5 relative, and NaN (never
  written, poisoned) in exactly the same places;
* then the Triton runner's caches are set to the reference's, so each step attends the same
  quantized cache.
"""

from __future__ import annotations

import json
import textwrap

import pytest
from _fastdeploy_host import host_or_skip, run_scenario
from _model_runner_host import RUNNER_PRELUDE

QUANT = {"quantization": "mix_quant", "kv_cache_quant_type": "block_wise_fp8"}

COMMON = r"""
import os
import pickle
from types import SimpleNamespace

from fastdeploy.model_executor.layers.quantization import parse_quant_config

NAN_CODE = 0x7F


def quant_config(model_dir, **kw):
    cfg = make_config(model_dir, model_impl="paddlefleet", block_size=BLOCK, quantization=dict(QUANT), **kw)
    args = SimpleNamespace(quantization=dict(QUANT), dynamic_load_weight=False, tensor_parallel_size=1)
    cfg.quant_config = parse_quant_config(args, cfg.model_config, is_ernie=False, is_v1_loader=True)
    return cfg


def build(backend, runner_cls, num_blocks, **kw):
    os.environ["FDFLEET_BACKEND"] = backend  # read when the model is built
    runner = make_runner(runner_cls, quant_config(MODEL_DIR, **kw))
    runner.load_model()
    assert runner.model.backend.name == backend, runner.model.backend.name
    assert runner.model.kv_quant.name == "block_wise_fp8"
    runner.num_gpu_blocks = num_blocks
    runner.initialize_kv_cache()
    assert runner.cache_kvs_map, "no named cache tensors"
    for name, t in runner.cache_kvs_map.items():  # NaN everywhere until written
        t[...] = NAN_CODE if "uint8" in str(t.dtype) else float("nan")
    return runner


def tensors(runner):
    return {name: t.numpy().copy() for name, t in runner.cache_kvs_map.items()}


def adjacent(a, b):
    # e4m3 bytes of one sign are monotonic in value: one step apart is a byte difference of 1
    # within a sign, or +0 / -0
    same_sign = (a & 0x80) == (b & 0x80)
    step = np.abs(a.astype(np.int32) - b.astype(np.int32)) == 1
    zeros = ((a & 0x7F) == 0) & ((b & 0x7F) == 0)
    return (same_sign & step) | zeros


def compare_caches(ref, tri, exact_names):
    # bytes written by the two backends this step; then the triton caches become the reference's
    a, b = tensors(ref), tensors(tri)
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    out = {"codes": 0, "code_diffs": 0, "nonadjacent": 0, "scale_rel": 0.0, "nan_mismatch": 0,
           "exact_mismatch": [], "written_codes": 0}
    for name in a:
        x, y = a[name], b[name]
        if x.dtype == np.uint8:
            diff = x != y
            out["codes"] += int(x.size)
            out["written_codes"] += int((x != NAN_CODE).sum())
            out["code_diffs"] += int(diff.sum())
            out["nonadjacent"] += int((diff & ~adjacent(x, y)).sum())
            out["nan_mismatch"] += int(((x == NAN_CODE) != (y == NAN_CODE)).sum())
            same = np.array_equal(x, y)
        else:
            nx, ny = np.isnan(x), np.isnan(y)
            out["nan_mismatch"] += int((nx != ny).sum())
            ok = ~nx & ~ny
            if ok.any():
                rel = np.abs(x[ok] - y[ok]) / np.maximum(np.abs(x[ok]), 1e-30)
                out["scale_rel"] = max(out["scale_rel"], float(rel.max()))
            same = np.array_equal(x, y, equal_nan=True)
        if name in exact_names and not same:
            out["exact_mismatch"].append(name)
    for name, t in tri.cache_kvs_map.items():
        ptr = t.data_ptr()
        t.copy_(ref.cache_kvs_map[name], False)
        assert t.data_ptr() == ptr  # in place: the layers' views see it
    assert all(np.array_equal(t.numpy(), a[n], equal_nan=True) for n, t in tri.cache_kvs_map.items())
    return out


def run_both(ref, tri, this, enc, dec, ids, tables=None):
    outs = []
    for runner in (ref, tri):
        ids_t = fill_step_inputs(runner, this, enc, dec, ids)
        if tables is not None:
            runner.share_inputs["block_tables"][:] = -1
            runner.share_inputs["block_tables"][:, : tables.shape[1]] = paddle.to_tensor(tables)
        runner.initialize_forward_meta()
        hidden = runner.model({"ids_remove_padding": ids_t}, runner.forward_meta)
        logits = runner.model.compute_logits(hidden, runner.forward_meta)
        outs.append((hidden.astype("float32").numpy(), logits.astype("float32").numpy()))
    (h0, l0), (h1, l1) = outs
    return {
        "hidden": float(np.abs(h0 - h1).max()), "logits": float(np.abs(l0 - l1).max()),
        "finite": bool(np.isfinite(h0).all() and np.isfinite(h1).all() and np.isfinite(l1).all()),
        "argmax_same": bool((l0.argmax(-1) == l1.argmax(-1)).all()), "tokens": len(ids),
    }
"""

FASTDEPLOY = r"""
from fastdeploy.worker.gpu_model_runner import GPUModelRunner

SLOTS, NUM_BLOCKS, MAX_BLOCKS = 4, 16, 8
SCHEDULE = [  # slot -> new tokens
    {0: 6, 1: 5},  # a prefill; the first chunk of a chunked prefill
    {0: 1, 1: 4, 2: 3},  # decode; the second chunk; a request joins
    {0: 1, 1: 1, 2: 1},  # decode (slot 3 idle)
    {0: 1, 2: 1, 3: 7},  # decode mixed with a new prefill
]
kw = dict(max_model_len=64, max_num_seqs=SLOTS)
ref = build("reference", GPUModelRunner, NUM_BLOCKS, **kw)
tri = build("triton", GPUModelRunner, NUM_BLOCKS, **kw)
suffix = [n for n in ref.cache_kvs_map if n.startswith("key_caches_0_")][0][len("key_caches_0_"):]
layer0 = {f"{kind}_{suffix}" for kind in ("key_caches_0", "value_caches_0", "key_cache_scales_0",
                                           "value_cache_scales_0")}
assert layer0 <= set(ref.cache_kvs_map), sorted(ref.cache_kvs_map)
rng = np.random.default_rng(0)
free = [int(b) for b in rng.permutation(NUM_BLOCKS)]
tokens, blocks, steps = {}, {}, []
for work in SCHEDULE:
    dec, this, enc, ids = [], [], [], []
    tables = np.full([SLOTS, MAX_BLOCKS], -1, dtype="int32")
    for slot in range(SLOTS):
        new = [int(t) for t in rng.integers(3, 256, work.get(slot, 0))]
        cached = len(tokens.get(slot, []))
        dec.append(cached if new else 0)
        this.append(len(new))
        enc.append(len(new) if new and (len(new) > 1 or cached == 0) else 0)
        own = blocks.setdefault(slot, [])
        while len(own) * BLOCK < cached + len(new):
            own.append(free.pop())
        tables[slot, : len(own)] = own
        ids += new
        tokens.setdefault(slot, []).extend(new)
    step = run_both(ref, tri, this, enc, dec, ids, tables)
    step.update(compare_caches(ref, tri, layer0))
    steps.append(step)
report(steps=steps, uniform=[ref.model_config.num_key_value_heads, ref.model_config.head_dim],
       runner=type(ref).__name__,
       layers=[[la.num_kv_heads, la.qk_head_dim, la.v_head_dim] for la in ref.model.plan])
"""

RECYCLING = r"""
import fastdeploy.worker.gpu_worker as gw
from fastdeploy.engine.request import BatchRequest, Request, RequestType
from fastdeploy.engine.sampling_params import SamplingParams

from fastdeploy_paddlefleet.kvcache.headwise import HeadwiseKVManager
from fastdeploy_paddlefleet.serving.kv_recycling.protocol import TASK_ATTR, KVDelta

SLOTS, MAX_LEN, CHUNK = 2, 64, 8
REQUESTS = [(19, 4), (14, 5), (22, 3)]  # (prompt, decode): prompts past every window (8)
kw = dict(max_model_len=MAX_LEN, max_num_seqs=SLOTS, max_num_batched_tokens=MAX_LEN)
runners = []
for backend in ("reference", "triton"):
    os.environ["FDFLEET_KV_RECYCLE"] = "auto"
    os.environ["FDFLEET_BACKEND"] = backend
    r = make_runner(gw.ModelRunner, quant_config(MODEL_DIR, **kw))
    r.load_model()
    assert r.fleet is not None and r.fleet.tables is not None, "window recycling is not on"
    r.num_gpu_blocks = BLOCKS
    r.initialize_kv_cache()
    for t in r.cache_kvs_map.values():
        t[...] = NAN_CODE if "uint8" in str(t.dtype) else float("nan")
    assert r.model.backend.name == backend
    runners.append(r)
ref, tri = runners
layout = ref.fleet.layout
assert tri.fleet.num_pages == ref.fleet.num_pages
mgr = HeadwiseKVManager.shared(layout.groups, ref.fleet.num_pages, BLOCK, layout.mode)
suffix = [n for n in ref.cache_kvs_map if n.startswith("key_caches_slot0_")][0][len("key_caches_slot0_"):]
scale_names = [n for n in ref.cache_kvs_map if "scales" in n]
assert scale_names, sorted(ref.cache_kvs_map)

eos = [2] * ref.model_config.eos_tokens_lens
params = SamplingParams(
    top_p=1.0, top_k=0, min_p=0.0, temperature=1.0, repetition_penalty=1.0, frequency_penalty=0.0,
    presence_penalty=0.0, max_tokens=MAX_LEN, min_tokens=1,
)


def poison(gi, unit):
    # a released page of the pool, in both runners: NaN codes and NaN scales in every slot its group reads
    for runner in runners:
        for t in range(len(layout.groups[gi].layers)):
            for role in ("key", "value"):
                runner.cache_kvs_map[f"{role}_caches_slot{t}_{suffix}"][unit] = NAN_CODE
                runner.cache_kvs_map[f"{role}_cache_scales_slot{t}_{suffix}"][unit] = float("nan")


def held_units(lanes):
    return [(gi, u) for gi, group in enumerate(lanes) for lane in group for u in lane if u >= 0]


rng = np.random.default_rng(SEED)
reqs = [{"id": f"r{i}", "tokens": [int(t) for t in rng.integers(3, 256, p + d)], "prompt": p, "done": 0,
         "slot": None, "seq": 0, "sent": None} for i, (p, d) in enumerate(REQUESTS)]
waiting, slots = list(reqs), [None] * SLOTS
owners, steps = {}, []
stats = {"released": 0, "reused_by_other": 0, "finished": 0}


def task(req, kind, start=0, end=0):
    t = Request(req["id"], prompt_token_ids=req["tokens"][: req["prompt"]], eos_token_ids=eos,
                sampling_params=params, prefill_start_index=start, prefill_end_index=end)
    t.idx, t.task_type, t.output_token_ids = req["slot"], kind, []
    t.block_tables = list(range(-(-end // BLOCK)))
    return t


while waiting or any(slots):
    for s in range(SLOTS):
        if slots[s] is None and waiting:
            req = waiting.pop(0)
            req["slot"], slots[s] = s, req
            mgr.admit(req["id"])
    work = {}
    for s, req in enumerate(slots):
        if req is None:
            continue
        n = min(CHUNK, req["prompt"] - req["done"]) if req["done"] < req["prompt"] else 1
        if not mgr.reserve(req["id"], min(MAX_LEN, req["done"] + n + BLOCK), req["done"]):
            raise RuntimeError("the pools are too small for this trace")
        work[s] = n
    tasks = []
    for s, n in work.items():
        req = slots[s]
        lanes, old, changes = mgr.lane_ids(req["id"]), req["sent"], []
        for gi, group in enumerate(lanes):
            for li, ids in enumerate(group):
                prev = old[gi][li] if old is not None else []
                for b in range(max(len(ids), len(prev))):
                    new_u = ids[b] if b < len(ids) else -1
                    old_u = prev[b] if b < len(prev) else -1
                    if new_u != old_u:
                        changes.append((gi, li, b, new_u))
                        if old_u >= 0:
                            poison(gi, old_u)
                            stats["released"] += 1
                        if new_u >= 0:
                            if owners.get((gi, new_u)) not in (None, req["id"]):
                                stats["reused_by_other"] += 1
                            owners[(gi, new_u)] = req["id"]
        prefill = req["done"] < req["prompt"]
        if not (changes or prefill or old is None):
            req["sent"] = lanes
            continue
        req["seq"] += 1
        nb = max((len(ids) for group in lanes for ids in group), default=0)
        t = task(req, RequestType.PREFILL if prefill else RequestType.DECODE, req["done"], req["done"] + n)
        delta = KVDelta(req["id"], req["seq"], old is None, nb, tuple(changes), layout.layout_id)
        setattr(t, TASK_ATTR, delta)
        tasks.append(t)
        req["sent"] = lanes
    if tasks:
        for runner in runners:
            batch = BatchRequest()
            for t in tasks:
                batch.add_request(pickle.loads(pickle.dumps(t)))  # engine -> worker
            runner.insert_tasks_v1(batch, SLOTS)
    this, enc, dec, ids = [], [], [], []
    for s in range(SLOTS):
        req, n = slots[s], work.get(s, 0)
        this.append(n)
        dec.append(req["done"] if req is not None and n else 0)
        enc.append(n if req is not None and n and req["done"] < req["prompt"] else 0)
        if n:
            ids += req["tokens"][req["done"] : req["done"] + n]
    step = run_both(ref, tri, this, enc, dec, ids)
    step.update(compare_caches(ref, tri, ()))
    steps.append(step)
    for s, n in work.items():
        req = slots[s]
        req["done"] += n
        if req["done"] == len(req["tokens"]):
            for gi, u in held_units(req["sent"]):
                poison(gi, u)
            mgr.finish(req["id"])
            slots[s] = None
            stats["finished"] += 1
report(steps=steps, stats=stats, kinds=sorted({g["kind"] for g in layout.to_dict()["groups"]}),
       num_pages=ref.fleet.num_pages)
"""


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from fastdeploy_paddlefleet.serving.modeldir import write_model_dir

    root = tmp_path_factory.mktemp("kvqforward")
    return {name: str(write_model_dir(name, root / name, dtype="float32", seed=0)) for name in ("tiny",)}


def _run(model_dir: str, body: str, env: dict[str, str], **consts) -> dict:
    pytest.importorskip("safetensors")
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    host = host_or_skip()
    head = f"MODEL_DIR = {json.dumps(model_dir)}\nQUANT = {QUANT!r}\nBLOCK = 4\n"
    head += "".join(f"{k} = {v!r}\n" for k, v in consts.items())
    script = head + textwrap.dedent(RUNNER_PRELUDE) + textwrap.dedent(COMMON) + textwrap.dedent(body)
    return run_scenario(script, host=host, env={"FD_PLUGINS": "paddlefleet", **env}, timeout=600).check().data


def _check_steps(steps: list[dict]) -> None:
    for i, s in enumerate(steps):
        assert s["finite"], (i, s)  # no read of a never-written or poisoned slot, either backend
        assert s["hidden"] <= 1e-4 and s["logits"] <= 1e-4, (i, s)
        assert s["argmax_same"], (i, s)
        assert s["nan_mismatch"] == 0 and s["nonadjacent"] == 0, (i, s)  # the same slots, the same rule
        assert s["code_diffs"] <= 0.005 * max(1, s["written_codes"]), (i, s)
        assert s["scale_rel"] <= 1e-5, (i, s)
        assert s["exact_mismatch"] == [], (i, s)


def test_fastdeploys_allocation_triton_equals_reference(model_dirs):
    d = _run(model_dirs["tiny"], FASTDEPLOY, {"FDFLEET_KV_RECYCLE": "off"})
    print(d["steps"])  # -rP
    assert d["runner"] == "GPUModelRunner"
    assert d["uniform"] == [2, 16]  # FastDeploy's one shape: the largest layer
    assert [2, 16, 8] in d["layers"]  # ... so narrower layers read strided views of it
    assert len(d["steps"]) == 4
    assert sum(s["written_codes"] for s in d["steps"][-1:]) > 0
    _check_steps(d["steps"])


def test_recycled_pages_triton_equals_reference(model_dirs):
    d = _run(model_dirs["tiny"], RECYCLING, {}, SEED=3, BLOCKS=24)
    print(
        d["stats"],
        d["num_pages"],
        [(s["hidden"], s["logits"], s["code_diffs"], s["scale_rel"]) for s in d["steps"]],
    )  # -rP
    assert "headwise" in d["kinds"], d["kinds"]
    st = d["stats"]
    assert st["finished"] == 3 and st["released"] > 0 and st["reused_by_other"] > 0, st
    assert any(s["tokens"] > 1 for s in d["steps"]) and any(s["tokens"] == 1 for s in d["steps"])
    _check_steps(d["steps"])
