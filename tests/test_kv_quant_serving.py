"""Serving a quantized KV cache (issue 31): which quantization configs load, the per-layer
``QuantizedKVCache`` views of FastDeploy's cache list, and the checkpoint's static scales.

References are written out here (FastDeploy's ``load_scale``: ``s.cast(dtype) / max_bound``; the
view shapes from the layer's own heads and dims), never taken from the code under test."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from fastdeploy_paddlefleet.kvcache.quant import FORMATS
from fastdeploy_paddlefleet.serving.checks import check_quantization, kv_cache_quant_of

ARCH = "PaddleFleetForCausalLM"


def fd(quantization=None, quantization_config=None, quant_config=None):
    return SimpleNamespace(
        model_config=SimpleNamespace(quantization=quantization, quantization_config=quantization_config),
        quant_config=quant_config,
    )


def mix_quant(kv=None, dense=None, moe=None, channel_wise=False, zp=False):
    """FastDeploy's MixQuantConfig's fields (model_executor/layers/quantization/mix_quant.py)."""
    return SimpleNamespace(
        name=lambda: "mix_quant", dense_quant_type=dense, moe_quant_type=moe, image_moe_quant_type=None,
        kv_cache_quant_type=kv, is_channel_wise=channel_wise, has_zero_point=zp,
    )  # fmt: skip


@pytest.mark.parametrize(
    "kv,name", [("block_wise_fp8", "block_wise_fp8"), ("float8_e4m3fn", "float8_e4m3fn"), ("int8", "int8")]
)
def test_kv_only_configs_are_accepted(kv, name):
    cli = {"quantization": "mix_quant", "kv_cache_quant_type": kv}
    for config in (
        fd(quantization=cli, quant_config=mix_quant(kv)),
        fd(quantization_config=dict(cli), quant_config=mix_quant(kv)),
        fd(quant_config=mix_quant(kv)),
    ):
        fmt = kv_cache_quant_of(config, ARCH)
        assert fmt.name == name and fmt.code == ("int8" if name == "int8" else "fp8")
        assert fmt.dynamic is (name == "block_wise_fp8")
        check_quantization(config, ARCH)
    assert kv_cache_quant_of(fd(), ARCH) is None


def test_static_fp8_channel_wise_follows_the_config():
    cw = kv_cache_quant_of(fd(quant_config=mix_quant("float8_e4m3fn", channel_wise=True)), ARCH)
    assert cw.channel_wise is True
    assert kv_cache_quant_of(fd(quant_config=mix_quant("int8")), ARCH).channel_wise is True  # always


@pytest.mark.parametrize(
    "config,fragments",
    [
        (fd(quantization={"quantization": "wint8"}), ["--quantization", "wint8"]),
        (fd(quantization="wint4"), ["--quantization", "wint4"]),
        (
            fd(quantization={"quantization": "mix_quant", "dense_quant_type": "wint8",
                             "kv_cache_quant_type": "int8"}),
            ["dense_quant_type='wint8'"],
        ),
        (fd(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
         ["quantization_config", "fp8"]),
        (fd(quant_config=mix_quant("block_wise_fp8", moe="w4a8")), ["moe_quant_type='w4a8'"]),
        (fd(quant_config=SimpleNamespace(name=lambda: "block_wise_fp8")), ["quant_config", "block_wise_fp8"]),
    ],
)  # fmt: skip
def test_weight_quantization_stays_refused_by_name(config, fragments):
    with pytest.raises(ValueError) as e:
        kv_cache_quant_of(config, ARCH)
    for f in fragments:
        assert f in str(e.value), str(e.value)


@pytest.mark.parametrize("kv", ["int8_zp", "int4_zp", "float8_e4m3fn_zp", "float8_e4m3"])
def test_refused_kv_formats_are_named(kv):
    with pytest.raises(ValueError, match=f"kv_cache_quant_type='{kv}'"):
        kv_cache_quant_of(fd(quant_config=mix_quant(kv)), ARCH)


def test_zero_point_flag_and_disagreeing_sources_are_refused():
    with pytest.raises(ValueError, match="has_zero_point=True"):
        kv_cache_quant_of(fd(quant_config=mix_quant("int8", zp=True)), ARCH)
    cli = {"quantization": "mix_quant", "kv_cache_quant_type": "int8"}
    with pytest.raises(ValueError, match="disagree"):
        kv_cache_quant_of(fd(quantization=cli, quant_config=mix_quant("block_wise_fp8")), ARCH)


# ---- views (need paddle) -------------------------------------------------------------------------


def _paddle():
    return pytest.importorskip("paddle", reason="the cache views are paddle tensors")


def _layers():
    from fastdeploy_paddlefleet.plan.layer import LayerAttention

    return [
        LayerAttention(index=0, kind="full", num_q_heads=4, num_kv_heads=2, qk_head_dim=8, v_head_dim=8,
                       softmax_scale=0.3),
        LayerAttention(index=1, kind="full", num_q_heads=4, num_kv_heads=1, qk_head_dim=8, v_head_dim=4,
                       softmax_scale=0.3),
    ]  # fmt: skip


def test_block_wise_fp8_views_of_fastdeploys_uniform_list():
    paddle = _paddle()
    from fastdeploy_paddlefleet.backends.base import QuantizedKVCache
    from fastdeploy_paddlefleet.serving.forward_meta import layer_caches

    nb, h, bs, d = 3, 2, 4, 8
    items = []
    for _ in range(2):  # FastDeploy: [k, v, k_scales, v_scales] per layer, one shape for every layer
        items += [paddle.zeros([nb, h, bs, d], "uint8"), paddle.zeros([nb, h, bs, d], "uint8")]
        items += [paddle.zeros([nb, h, bs], "bfloat16"), paddle.zeros([nb, h, bs], "bfloat16")]
    views = layer_caches(items, _layers(), FORMATS["block_wise_fp8"])
    assert all(isinstance(v, QuantizedKVCache) for v in views)
    assert [list(v.key.shape) for v in views] == [[nb, 2, bs, 8], [nb, 1, bs, 8]]
    assert [list(v.value.shape) for v in views] == [[nb, 2, bs, 8], [nb, 1, bs, 4]]
    assert [list(v.key_scale.shape) for v in views] == [[nb, 2, bs], [nb, 1, bs]]
    assert views[1].value.dtype == paddle.uint8 and views[1].value_scale.dtype == paddle.bfloat16
    # a view shares the cache's memory: a write through it lands in FastDeploy's tensor
    views[1].key_scale[1, 0, 2] = 3.0
    assert float(items[6][1, 0, 2]) == 3.0 and float(items[6][1, 1, 2]) == 0.0
    # head-wise pages: the scales' page view [num_blocks * Hkv, block_size] matches the codes'
    page = views[0].key_scale.reshape([nb * 2, bs])
    assert list(page.shape) == [nb * 2, bs]


def test_quantized_list_errors_name_the_entry():
    paddle = _paddle()
    from fastdeploy_paddlefleet.serving.forward_meta import layer_caches

    u8 = [paddle.zeros([2, 2, 4, 8], "uint8") for _ in range(4)]
    sc = [paddle.zeros([2, 2, 4], "float32") for _ in range(4)]
    with pytest.raises(ValueError, match="needs|4 per layer|tensors for 2 layers"):
        layer_caches(u8, _layers(), FORMATS["block_wise_fp8"])  # scales missing
    bad = [u8[0], u8[1], sc[0], sc[1], paddle.zeros([2, 2, 4, 8], "float32"), u8[3], sc[2], sc[3]]
    with pytest.raises(TypeError, match="layer 1 key.*uint8"):
        layer_caches(bad, _layers(), FORMATS["block_wise_fp8"])
    wrong = [u8[0], u8[1], paddle.zeros([2, 2, 5], "float32"), sc[1], u8[2], u8[3], sc[2], sc[3]]
    with pytest.raises(ValueError, match="layer 0: the key scales"):
        layer_caches(wrong, _layers(), FORMATS["block_wise_fp8"])
    with pytest.raises(ValueError, match="scale_names|cachek_matmul.activation_scale"):
        layer_caches(u8, _layers(), FORMATS["int8"])  # static: no scales loaded


KN = "decoder.layers.0.self_attn.cachek_matmul.activation_scale"
VN = "decoder.layers.0.self_attn.cachev_matmul.activation_scale"


def test_static_scales_are_fastdeploys_dequant_multipliers_cut_per_rank():
    paddle = _paddle()
    from fastdeploy_paddlefleet.plan.layer import LayerAttention
    from fastdeploy_paddlefleet.serving.kv_scales import StaticKVScales

    # rank 1 of 2: kv heads 2..3 of 4, head dim 4
    layer = LayerAttention(index=0, kind="full", num_q_heads=4, num_kv_heads=2, qk_head_dim=4, v_head_dim=4,
                           softmax_scale=0.5, kv_head_range=(2, 4), q_head_range=(4, 8))  # fmt: skip
    k = np.arange(1, 17, dtype="float32")  # per channel, every kv head: [4 * 4]
    v = np.arange(101, 117, dtype="float32")
    for fmt, bound in ((FORMATS["int8"], 127.0),):
        store = StaticKVScales({0: "decoder.layers.0.self_attn"}, fmt)
        sd = {
            "model.decoder.layers.0.self_attn.cachek_matmul.activation_scale": k,
            "decoder.layers.0.self_attn.cachev_matmul.activation_scale": v,
            "decoder.layers.0.mlp.weight": np.zeros(2),
        }
        assert store.take(sd) == 2 and list(sd) == ["decoder.layers.0.mlp.weight"]
        store.finish([layer], "bfloat16")
        ks, vs = store[0]
        ref_k = (paddle.to_tensor(k[8:16]).cast("bfloat16") / bound).cast("float32").numpy()
        ref_v = (paddle.to_tensor(v[8:16]).cast("bfloat16") / bound).cast("float32").numpy()
        assert ks.dtype == paddle.bfloat16 and list(ks.shape) == [8]
        np.testing.assert_array_equal(ks.cast("float32").numpy(), ref_k)
        np.testing.assert_array_equal(vs.cast("float32").numpy(), ref_v)
    # per kv head (fp8): [kv_heads] of every head -> this rank's two, / 448
    store = StaticKVScales({0: "decoder.layers.0.self_attn"}, FORMATS["float8_e4m3fn"])
    store.take({KN: np.array([1, 2, 3, 4], "float32"), VN: np.array([5, 6, 7, 8], "float32")})
    store.finish([layer], "float32")
    np.testing.assert_allclose(store[0][0].numpy(), np.array([3, 4], "float32") / np.float32(448))
    # a missing tensor is named
    store = StaticKVScales({0: "decoder.layers.0.self_attn"}, FORMATS["float8_e4m3fn"])
    store.take({"decoder.layers.0.self_attn.cachek_matmul.activation_scale": np.ones(4, "float32")})
    with pytest.raises(ValueError, match="'decoder.layers.0.self_attn.cachev_matmul.activation_scale'"):
        store.finish([layer], "float32")
    # a wrong size is named
    store = StaticKVScales({0: "decoder.layers.0.self_attn"}, FORMATS["float8_e4m3fn"])
    store.take({KN: np.ones(3, "float32"), VN: np.ones(4, "float32")})
    with pytest.raises(ValueError, match="cachek_matmul.activation_scale has 3 values"):
        store.finish([layer], "float32")


def test_static_views_carry_the_loaded_scales():
    paddle = _paddle()
    from fastdeploy_paddlefleet.serving.forward_meta import layer_caches

    scales = {0: ("k0", "v0"), 1: ("k1", "v1")}
    u8 = [paddle.zeros([2, 2, 4, 8], "uint8") for _ in range(4)]
    views = layer_caches(u8, _layers(), FORMATS["float8_e4m3fn"], scales)
    assert [(v.key_scale, v.value_scale) for v in views] == [("k0", "v0"), ("k1", "v1")]
    assert [list(v.value.shape) for v in views] == [[2, 2, 4, 8], [2, 1, 4, 4]]
