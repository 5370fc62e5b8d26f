"""FastDeploy's one cache shape for every layer: sizing, per-layer strided views, kernels and backends
reading them in place.

The kernels run under ``TRITON_INTERPRET=1`` on CPU (conftest). Every uniform cache starts as NaN:
the heads and channels a layer does not own stay NaN after the step (nothing is written outside
the layer's part) and a read of them would poison the output (nothing is read outside it). Results
are compared with dense attention (``tests/_dense_attention.py``, numpy float64), not with another
backend.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from _dense_attention import dense_attention

paddle = pytest.importorskip("paddle")

from fastdeploy_paddlefleet.backends import get_backend  # noqa: E402
from fastdeploy_paddlefleet.plan import plan_from_config  # noqa: E402
from fastdeploy_paddlefleet.plan.layer import LayerAttention  # noqa: E402
from fastdeploy_paddlefleet.presets import load_preset  # noqa: E402
from fastdeploy_paddlefleet.runner.batch import PagedKVState  # noqa: E402
from fastdeploy_paddlefleet.serving.cache_views import (  # noqa: E402
    UniformCache,
    check_cache_list,
    check_fastdeploy_cache_settings,
    fastdeploy_kv_heads,
    fit_fastdeploy_model_config,
    layer_cache_views,
    uniform_cache,
    uniform_cost,
)


def _fd_model_config(preset: str) -> SimpleNamespace:
    """The two fields as FastDeploy's ModelConfig reads them from config.json (head_dim defaults to
    hidden_size // num_attention_heads, num_key_value_heads to -1)."""
    raw = load_preset(preset)
    return SimpleNamespace(
        model=preset,
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw.get("num_key_value_heads", -1),
        head_dim=raw.get("head_dim", raw["hidden_size"] // raw["num_attention_heads"]),
    )


# ------------------------------------------------------------------------- sizing FastDeploy's shape


@pytest.mark.parametrize("preset", ["tiny", "tiny-mla", "deepseek-v3", "mimo-v2-flash-like", "gpt-oss-20b"])
def test_fitted_model_config_holds_every_layer_on_every_rank(preset):
    mc = _fd_model_config(preset)
    fit_fastdeploy_model_config(mc, plan_from_config(preset))
    for tp in (1, 2, 4):
        try:
            plans = [plan_from_config(preset, tp, r) for r in range(tp)]
        except ValueError:  # heads not divisible by this tp
            continue
        heads = fastdeploy_kv_heads(mc.num_key_value_heads, tp)  # the runner's formula
        for plan in plans:
            for layer in plan:
                assert layer.num_kv_heads <= heads, (tp, layer)
                assert max(layer.qk_head_dim, layer.v_head_dim) <= mc.head_dim, layer
    assert mc.num_attention_heads % mc.num_key_value_heads == 0


def test_fit_raises_what_fastdeploy_would_undersize_and_is_idempotent():
    mc = _fd_model_config("tiny-mla")  # no head_dim: FastDeploy takes 64 // 4 = 16, MLA q/k heads are 24
    assert mc.head_dim == 16
    changes = fit_fastdeploy_model_config(mc)
    # and the config's num_key_value_heads=2 is not what MLA's core attention caches (one per q head)
    assert changes == {"num_key_value_heads": (2, 4), "head_dim": (16, 24)}
    assert fit_fastdeploy_model_config(mc) == {}
    mc.head_dim = 512  # never lowered
    assert fit_fastdeploy_model_config(mc) == {} and mc.head_dim == 512


def test_fit_refuses_a_kv_head_count_that_does_not_divide_the_heads():
    layers = [
        LayerAttention(index=0, kind="full", num_q_heads=6, num_kv_heads=2, qk_head_dim=8, v_head_dim=8,
                       softmax_scale=0.3),
        LayerAttention(index=1, kind="sliding", num_q_heads=6, num_kv_heads=3, qk_head_dim=8, v_head_dim=8,
                       softmax_scale=0.3, window_left=3, sliding_kv_heads=(0, 3)),
    ]  # fmt: skip
    plan = type("P", (), {"tp_size": 1, "__iter__": lambda self: iter(layers)})()
    mc = SimpleNamespace(model="x", num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="num_attention_heads=8 is not a multiple of num_key_value_heads=3"):
        fit_fastdeploy_model_config(mc, plan)


def test_uniform_cost_of_tiny_mla():
    cost = uniform_cost(plan_from_config("tiny-mla"), "bf16")
    # 3 layers x 4 kv heads: uniform K and V of 24 channels each, against 24 (K) + 16 (V)
    assert (cost.num_kv_heads, cost.head_dim) == (4, 24)
    assert cost.bytes_per_token_uniform == 3 * 4 * (24 + 24) * 2
    assert cost.bytes_per_token_per_layer_sizing == 3 * 4 * (24 + 16) * 2
    assert cost.to_dict()["overhead"] == pytest.approx(1.2)


def test_settings_with_other_cache_layouts_are_refused_naming_them():
    with pytest.raises(ValueError, match="FD_ATTENTION_BACKEND=MLA_ATTN"):
        check_fastdeploy_cache_settings(None, {"FD_ATTENTION_BACKEND": "MLA_ATTN"})
    # served quantized caches pass (issue 31); the formats kvcache.quant refuses are named
    for served in ("block_wise_fp8", "float8_e4m3fn", "int8", "cache_fp8"):
        fd = SimpleNamespace(quant_config=SimpleNamespace(kv_cache_quant_type=served), model_config=None)
        check_fastdeploy_cache_settings(fd, {})
    fd = SimpleNamespace(
        quant_config=None, model_config=SimpleNamespace(quantization={"kv_cache_quant_type": "int8_zp"})
    )
    with pytest.raises(ValueError, match="kv_cache_quant_type='int8_zp'"):
        check_fastdeploy_cache_settings(fd, {})
    check_fastdeploy_cache_settings(SimpleNamespace(quant_config=None, model_config=None), {})  # plain: fine

    k = paddle.zeros([2, 1, 4, 8])
    with pytest.raises(ValueError, match="MLA_ATTN"):
        check_cache_list([k, k, k], 3)  # one tensor per layer
    with pytest.raises(ValueError, match="block_wise_fp8"):
        check_cache_list([k] * 8, 2)  # [k, v, k_scales, v_scales] per layer
    u8 = paddle.zeros([2, 1, 4, 8], dtype="uint8")
    with pytest.raises(TypeError, match="kv_cache_quant_type"):
        check_cache_list([u8, u8], 1)
    check_cache_list([k, k, k, k], 2)


# -------------------------------------------------------------------------------- per-layer views


def test_views_share_the_cache_and_name_the_field_when_too_small():
    layer = LayerAttention(index=0, kind="full", num_q_heads=4, num_kv_heads=2, qk_head_dim=8, v_head_dim=4,
                           softmax_scale=0.3)  # fmt: skip
    key, value = paddle.zeros([3, 4, 2, 8]), paddle.zeros([3, 4, 2, 8])
    ((kv, vv),) = layer_cache_views([(key, value)], [layer])
    assert list(kv.shape) == [3, 2, 2, 8] and list(vv.shape) == [3, 2, 2, 4]
    assert kv.data_ptr() == key.data_ptr() and vv.data_ptr() == value.data_ptr()
    vv[1, 1, 0, :] = 7.0  # lands in the shared memory, in the leading channels only
    assert value[1, 1, 0].numpy().tolist() == [7, 7, 7, 7, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="model_config.num_key_value_heads and model_config.head_dim"):
        layer_cache_views([(paddle.zeros([3, 1, 2, 8]), value)], [layer])
    assert UniformCache(2, 8).fits(layer) and not UniformCache(2, 4).fits(layer)


# ------------------------------------------------------------------- backends on FastDeploy's shape

LAYERS = [  # tiny-like: different kv heads, v < qk, a window, sinks, head-wise sliding
    LayerAttention(index=0, kind="full", num_q_heads=4, num_kv_heads=2, qk_head_dim=16, v_head_dim=16,
                   softmax_scale=0.25, sink="off-by-one"),
    LayerAttention(index=1, kind="sliding", num_q_heads=4, num_kv_heads=1, qk_head_dim=16, v_head_dim=8,
                   softmax_scale=0.25, window_left=5, sliding_kv_heads=(0, 1), sink="learnable"),
    LayerAttention(index=2, kind="headwise", num_q_heads=4, num_kv_heads=2, qk_head_dim=8, v_head_dim=8,
                   softmax_scale=0.35, window_left=3, sliding_kv_heads=(1, 2)),
]  # fmt: skip
SCHEDULE = [  # (request, new tokens): prefill, chunked prefill + decode mixed, decode
    [("a", 7), ("b", 3)],
    [("a", 1), ("b", 6), ("c", 4)],
    [("a", 1), ("b", 1), ("c", 1)],
]


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
def test_backends_on_views_of_one_uniform_cache_match_dense_attention(backend_name):
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    backend = get_backend(backend_name)
    shape = uniform_cache(LAYERS)
    assert (shape.num_kv_heads, shape.head_dim) == (2, 16)
    block_size, num_blocks = 4, 16
    state = PagedKVState(num_blocks, block_size, max_blocks_per_seq=8, shuffle_seed=3)
    full = [[paddle.full([num_blocks, 2, block_size, 16], float("nan")) for _ in range(2)] for _ in LAYERS]
    views = layer_cache_views([tuple(p) for p in full], LAYERS)
    rng = np.random.default_rng(0)
    hist: dict[tuple[int, str], list] = {}
    sinks = rng.normal(size=4).astype("float32") * 2
    worst = 0.0
    for step in SCHEDULE:
        ids = [rid for rid, _ in step]
        meta = state.schedule(step)
        t = sum(n for _, n in step)
        for layer, cache in zip(LAYERS, views, strict=True):
            h, hkv, dqk, dv = layer.num_q_heads, layer.num_kv_heads, layer.qk_head_dim, layer.v_head_dim
            q = rng.normal(size=(t, h, dqk)).astype("float32")
            k = rng.normal(size=(t, hkv, dqk)).astype("float32")
            v = rng.normal(size=(t, hkv, dv)).astype("float32")
            s = paddle.to_tensor(sinks) if layer.sink == "learnable" else None
            out = backend.forward(
                paddle.to_tensor(q), paddle.to_tensor(k), paddle.to_tensor(v), layer, meta, cache, s
            ).numpy()
            row = 0
            for rid, n in step:
                hk, hv = hist.setdefault(
                    (layer.index, rid), [np.zeros((0, hkv, dqk)), np.zeros((0, hkv, dv))]
                )
                hk = np.concatenate([hk, k[row : row + n]])
                hv = np.concatenate([hv, v[row : row + n]])
                hist[(layer.index, rid)] = [hk, hv]
                windows = [layer.head_window(x) for x in range(hkv)]
                sink = (
                    sinks
                    if layer.sink == "learnable"
                    else (np.zeros(4) if layer.sink == "off-by-one" else None)
                )
                want = dense_attention(
                    q[row : row + n],
                    hk,
                    hv,
                    len(hk) - n,
                    scale=layer.softmax_scale,
                    windows=windows,
                    sinks=sink,
                )
                got = out[row : row + n]
                assert np.isfinite(got).all(), f"layer {layer.index}: read outside its part of the cache"
                worst = max(worst, float(np.abs(got - want).max()))
                row += n
        assert len(ids) == len(step)
    assert worst < 1e-4, worst
    for layer, (key, value) in zip(LAYERS, full, strict=True):  # nothing written outside each layer's part
        k_np, v_np = key.numpy(), value.numpy()
        assert (
            np.isnan(k_np[:, layer.num_kv_heads :]).all() and np.isnan(k_np[..., layer.qk_head_dim :]).all()
        )
        assert np.isnan(v_np[:, layer.num_kv_heads :]).all() and np.isnan(v_np[..., layer.v_head_dim :]).all()


def test_kernels_on_torch_views_with_headwise_pages():
    """The kernels take torch strided views too (``stride(0)`` addresses blocks), head-wise pages
    numbered in the layer's own view."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from fastdeploy_paddlefleet.kernels.cache_write import write_kv_cache
    from fastdeploy_paddlefleet.kernels.paged_attention import paged_attention

    gen = torch.Generator().manual_seed(1)
    hkv, group, dqk, dv, bs, nb, wide_h, wide_d = 2, 2, 8, 4, 4, 10, 3, 16
    kc = torch.full((nb, wide_h, bs, wide_d), float("nan"))
    vc = torch.full((nb, wide_h, bs, wide_d), float("nan"))
    kview, vview = kc[:, :hkv, :, :dqk], vc[:, :hkv, :, :dv]
    reqs = [6, 9]  # one prefill each (no context): keys are exactly this step's tokens
    pages = torch.full((len(reqs) * hkv, 4), -1, dtype=torch.int32)
    free = torch.randperm(nb * hkv, generator=gen).tolist()
    for b, n in enumerate(reqs):
        for h in range(hkv):
            for j in range(-(-n // bs)):
                pages[b * hkv + h, j] = free.pop()
    t = sum(reqs)
    q = torch.randn(t, hkv * group, dqk, generator=gen)
    k = torch.randn(t, hkv, dqk, generator=gen)
    v = torch.randn(t, hkv, dv, generator=gen)
    cu = torch.tensor([0, reqs[0], t], dtype=torch.int32)
    dec = torch.zeros(2, dtype=torch.int32)
    bid = torch.repeat_interleave(torch.arange(2, dtype=torch.int32), torch.tensor(reqs))
    write_kv_cache(k, v, kview, vview, bid, cu, dec, pages, headwise=True)
    out = paged_attention(q, kview, vview, cu, dec, pages, scale=0.3, headwise=True)
    for b in range(2):
        lo, hi = int(cu[b]), int(cu[b + 1])
        want = dense_attention(
            q[lo:hi].numpy(),
            k[lo:hi].numpy(),
            v[lo:hi].numpy(),
            0,
            scale=0.3,
            windows=[None] * hkv,
            sinks=None,
        )
        np.testing.assert_allclose(out[lo:hi].reshape(hi - lo, -1).numpy(), want, atol=1e-5)
    assert (
        torch.isnan(kc[:, hkv:]).all()
        and torch.isnan(kc[..., dqk:]).all()
        and torch.isnan(vc[..., dv:]).all()
    )
    assert math.isfinite(float(out.sum()))


def test_fdfleet_plan_reports_the_uniform_shape_against_per_layer_sizing(capsys):
    import json

    from fastdeploy_paddlefleet.cli import main

    assert main(["plan", "tiny-mla", "--json", "--memory-gib", "1", "--block-size", "16"]) == 0
    u = json.loads(capsys.readouterr().out)["kv_cache"]["fastdeploy_uniform"]
    assert (u["num_kv_heads"], u["head_dim"]) == (4, 24)
    assert (u["bytes_per_token_uniform"], u["bytes_per_token_per_layer_sizing"]) == (1152, 960)
    assert u["num_blocks_uniform"] == (1 << 30) // (1152 * 16)
    assert main(["plan", "tiny-mla", "--memory-gib", "1", "--block-size", "16"]) == 0
    text = capsys.readouterr().out
    assert "FastDeploy's one cache shape for every layer" in text and "1.12 KiB vs 960 B" in text


def test_runner_allocates_fastdeploys_single_shape_as_views():
    from fastdeploy_paddlefleet.runner.batch import allocate_kv_caches

    caches = allocate_kv_caches(LAYERS, 6, 4, fill=float("nan"), uniform=True)
    bases = set()
    for layer, (key, value) in zip(LAYERS, caches, strict=True):
        assert list(key.shape) == [6, layer.num_kv_heads, 4, layer.qk_head_dim]
        assert list(value.shape) == [6, layer.num_kv_heads, 4, layer.v_head_dim]
        assert key.strides[0] == 2 * 4 * 16  # the single shape: 2 kv heads x 16 channels per slot
        bases.add(key.data_ptr())
    assert len(bases) == len(LAYERS)  # one tensor per layer, as FastDeploy allocates
