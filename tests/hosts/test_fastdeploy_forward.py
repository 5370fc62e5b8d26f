"""A forward through FastDeploy's REAL code paths, compared with dense attention.

In a fresh child process (``_fastdeploy_host.run_scenario``, ``FD_PLUGINS=paddlefleet``), for the
``tiny`` preset (per-layer v dims), ``tiny-mla`` (MLA: q/k 24, v 16, 4 kv heads where its config
says 2 and FastDeploy alone would read head_dim 16) and a uniform model (every layer the same):

1. FastDeploy builds its config (``EngineArgs(model_impl="paddlefleet").create_engine_config()``:
   the plugin sizes ``num_key_value_heads`` / ``head_dim`` there);
2. the caches are allocated the way ``GPUModelRunner`` does: kv heads ``max(1,
   num_key_value_heads // tp)`` into FastDeploy's ``AppendAttentionBackend``, ONE shape from its
   real ``get_kv_cache_shape`` for every layer, K and V alike, passed flat ``[k0, v0, k1, ...]``
   (filled with NaN instead of FastDeploy's zeros: a read outside a layer's part would show);
3. FastDeploy's v1 loader builds our class and loads the checkpoint;
4. four steps with FastDeploy's real ``ForwardMeta`` (prefill, chunked prefill, a request joining,
   mixed prefill + decode, decode; FastDeploy's ``[bsz, 1]`` lengths, an idle slot, shuffled
   blocks) run through ``model(inputs, forward_meta)`` as the runner calls it, and the logits are
   compared with minifleet's own dense forward (eager attention over the full sequence, no cache)
   on the same weights.

Both backends: ``reference`` (paddle ops) and ``triton`` (the kernels, interpreted on CPU).
"""

from __future__ import annotations

import json
import textwrap

import pytest
from _fastdeploy_host import host_or_skip, run_scenario

SCENARIO = """
import json
import numpy as np
import paddle
from safetensors.numpy import load_file

import fastdeploy
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.layers.attention.append_attn_backend import AppendAttentionBackend
from fastdeploy.model_executor.model_loader import get_model_loader

from fastdeploy_paddlefleet.minifleet import build_minifleet

BLOCK, NUM_BLOCKS, SLOTS, MAX_BLOCKS = 4, 40, 4, 8
SCHEDULE = [  # slot -> new tokens
    {0: 6, 1: 5},  # a prefill; the first chunk of a chunked prefill
    {0: 1, 1: 4, 2: 3},  # decode; the second chunk; a request joins
    {0: 1, 1: 1, 2: 1},  # decode (slot 3 idle)
    {0: 1, 2: 1, 3: 7},  # decode mixed with a new prefill
]
results = {}
for name, path in MODELS:
    cfg = EngineArgs(
        model=path, model_impl="paddlefleet", max_model_len=64, block_size=BLOCK
    ).create_engine_config()
    mc = cfg.model_config
    tp = cfg.parallel_config.tensor_parallel_size
    # GPUModelRunner._initialize_attn_backend / initialize_kv_cache, step by step
    kv_num_heads = max(1, int(mc.num_key_value_heads) // tp)
    attn = AppendAttentionBackend(
        cfg, kv_num_heads=kv_num_heads, num_heads=mc.num_attention_heads // tp, head_dim=mc.head_dim
    )
    key_shape, value_shape = attn.get_kv_cache_shape(max_num_blocks=NUM_BLOCKS)
    caches = []
    for _ in range(mc.num_hidden_layers):
        key = paddle.full(key_shape, float("nan"), "float32")
        caches += [key, paddle.full(value_shape, float("nan"), "float32")]

    model = get_model_loader(cfg.load_config).load_model(cfg)
    raw = json.load(open(path + "/config.json"))
    native = build_minifleet(raw, seed=0)
    native.set_state_dict({k: paddle.to_tensor(v) for k, v in load_file(path + "/model.safetensors").items()})
    native.eval()

    rng = np.random.default_rng(0)
    free = list(rng.permutation(NUM_BLOCKS))
    tokens, blocks = {}, {}
    worst = 0.0
    for work in SCHEDULE:
        dec, this, enc, ids, rows = [], [], [], [], []
        tables = np.full([SLOTS, MAX_BLOCKS], -1, dtype="int32")
        for slot in range(SLOTS):
            new = [int(t) for t in rng.integers(0, 256, work.get(slot, 0))]
            cached = len(tokens.get(slot, []))
            dec.append(cached)
            this.append(len(new))
            enc.append(len(new) if new and (len(new) > 1 or cached == 0) else 0)
            own = blocks.setdefault(slot, [])
            while len(own) * BLOCK < cached + len(new):
                own.append(int(free.pop()))
            tables[slot, : len(own)] = own
            ids += new
            rows += [(slot, cached + i) for i in range(len(new))]
            tokens.setdefault(slot, []).extend(new)
        cu = np.concatenate([[0], np.cumsum(this)]).astype("int32")
        bid = np.repeat(np.arange(SLOTS), this).astype("int32")
        ids_t = paddle.to_tensor(np.array(ids, "int64"))
        forward_meta = ForwardMeta(
            ids_remove_padding=ids_t,
            seq_lens_encoder=paddle.to_tensor(np.array(enc, "int32")[:, None]),
            seq_lens_decoder=paddle.to_tensor(np.array(dec, "int32")[:, None]),
            seq_lens_this_time=paddle.to_tensor(np.array(this, "int32")),
            cu_seqlens_q=paddle.to_tensor(cu),
            batch_id_per_token=paddle.to_tensor(np.concatenate([bid, np.zeros(2, "int32")])),  # padded
            block_tables=paddle.to_tensor(tables),
            caches=caches,
            attn_backend=attn,
            exist_prefill=any(e > 0 for e in enc),
        )
        hidden = model({"ids_remove_padding": ids_t}, forward_meta)
        logits = model.compute_logits(hidden, forward_meta).numpy()
        for slot in sorted({s for s, _ in rows}):
            with paddle.no_grad():
                ref = native(paddle.to_tensor([tokens[slot]], dtype="int64"))[0].numpy()
            idx = [i for i, (s, _) in enumerate(rows) if s == slot]
            pos = [p for s, p in rows if s == slot]
            worst = max(worst, float(np.abs(logits[idx] - ref[pos]).max()))
    model.clear_graph_opt_backend()  # what sleep / clear_parameters call: nothing captured, no error
    from fastdeploy.model_executor.graph_optimization.decorator import GraphOptWrapper

    results[name] = {
        "graph_wrapper": isinstance(model._graph_step, GraphOptWrapper),
        "cache_shape": [list(key_shape), list(value_shape)],
        "layers": [[l.num_kv_heads, l.qk_head_dim, l.v_head_dim] for l in model.plan],
        "backend": model.backend.name,
        "graph_step": type(model._graph_step).__name__,
        "worst": worst,
        "finite": bool(np.isfinite(logits).all()),
    }
report(results=results)
"""


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from fastdeploy_paddlefleet.presets import load_preset
    from fastdeploy_paddlefleet.serving.modeldir import write_model_dir

    uniform = load_preset("tiny")  # every layer 2 kv heads of 16 channels: FastDeploy's own shape fits
    uniform.update(swa_v_head_dim=16, swa_head_dim=16, swa_num_key_value_heads=2, v_head_dim=16)
    root = tmp_path_factory.mktemp("fdforward")
    return [
        (name, str(write_model_dir(preset, root / name, dtype="float32", seed=0)))
        for name, preset in (("tiny", "tiny"), ("tiny-mla", "tiny-mla"), ("uniform", uniform))
    ]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_forward_on_fastdeploy_cache_shape_matches_dense_attention(model_dirs, backend):
    pytest.importorskip("safetensors")
    if backend == "triton":
        pytest.importorskip("torch")
        pytest.importorskip("triton")
    host = host_or_skip()
    script = f"MODELS = {json.dumps(model_dirs)}\n" + textwrap.dedent(SCENARIO)
    env = {"FD_PLUGINS": "paddlefleet", "FDFLEET_BACKEND": backend}
    result = run_scenario(script, host=host, env=env, timeout=600).check()
    res = result.data["results"]
    print({n: (r["worst"], r["cache_shape"][0]) for n, r in res.items()})  # shown with -rP
    for name, r in res.items():
        assert r["backend"] == backend and r["finite"], (name, r)
        assert r["graph_step"] == "PaddleFleetStep" and r["graph_wrapper"], r  # FastDeploy's decorator
        key_shape, value_shape = r["cache_shape"]
        assert key_shape == value_shape and key_shape[0] == 40 and key_shape[2] == 4  # one shape, K and V
        for hkv, dqk, dv in r["layers"]:  # every layer fits in its leading heads / channels
            assert hkv <= key_shape[1] and max(dqk, dv) <= key_shape[3]
        assert r["worst"] < 1e-3, (name, r["worst"])
    # FastDeploy's shape as the plugin made FastDeploy size it: the largest layer
    assert res["tiny"]["cache_shape"][0][1::2] == [2, 16]
    assert res["tiny-mla"]["cache_shape"][0][1::2] == [4, 24]  # config: 2 kv heads, no head_dim (-> 16)
    assert res["uniform"]["cache_shape"][0][1::2] == [2, 16]
    assert {tuple(x) for x in res["uniform"]["layers"]} == {(2, 16, 16)}
    assert any(dv < 16 for _, _, dv in res["tiny"]["layers"])  # tiny really has a narrower V
