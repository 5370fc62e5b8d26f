"""Decode with the key tiles as the dots' rows (``attention_kernels._tile_key_rows``), forced on
(``paged_attention.DECODE_KEY_ROWS``) against the dense references: on unquantized caches, every decode
feature a bf16 / fp32 cache has (windows per head, sinks, head-wise pages with released NaN pages,
soft-capping, split-KV, pages smaller and larger than the key tile, q/k head dim != v head dim, GQA
groups of 1 to 16); on quantized caches, ``tests/test_kv_quant_attention.py``'s tests run again here
under this layout (imported below: this module's fixture forces it), masked NaN / Inf keys included.
Quantized caches take the layout where ``FDFLEET_DECODE_KEY_ROWS`` is on."""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import test_kv_quant_attention as kq  # noqa: E402
import test_triton_kernels as tk  # noqa: E402

# the quantized caches' tests, collected again in this module: they run under the key-rows fixture below
from test_kv_quant_attention import (  # noqa: E402, F401
    test_block_sizes_around_the_key_tile,
    test_fp16_inputs,
    test_fp16_small_values_keep_their_precision,
    test_gpu_fp8_reads_take_queries_and_value_scales_past_fp16s_range,
    test_gpu_fp16_small_values_keep_their_precision,
    test_head_dims,
    test_headwise_lanes,
    test_masked_causal_future_and_past_the_context,
    test_masked_headwise_windows,
    test_masked_outside_the_window_split_kv,
    test_masked_static_formats_codes,
    test_mixed_batch_every_format,
    test_mla_dims,
    test_sinks,
    test_sliding_window_with_released_pages,
    test_split_kv_decode,
)
from test_kv_quant_attention import test_qk_dim_differs_from_v_dim as test_quant_qk_dim_not_v_dim  # noqa: E402, F401
from test_kv_quant_attention import test_soft_cap as test_quant_soft_cap  # noqa: E402, F401
from test_triton_kernels import (  # noqa: E402
    CUDA,
    REAL,
    make_step,
    run_and_check,
    test_random_batches_match_dense_reference,  # noqa: E402, F401
)

from fastdeploy_paddlefleet.kernels.dense_reference import dense_attention  # noqa: E402

gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def key_rows(monkeypatch):
    from fastdeploy_paddlefleet.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "DECODE_KEY_ROWS", True)


DECODES = [(0, 1), (20, 1), (37, 1), (64, 1), (131, 1)]


@pytest.mark.parametrize("group", [1, 2, 4, 16])
@pytest.mark.parametrize("sink_kind", ["vanilla", "learnable", "off-by-one"])
def test_groups_and_sinks(group, sink_kind):
    s = make_step(DECODES, hkv=2, group=group, dqk=16, dv=16, block_size=16, seed=group)
    run_and_check(s, sink_kind=sink_kind)


@pytest.mark.parametrize("window", [0, 9, 40])
def test_windows_per_head_and_released_pages(window):
    kw = dict(hkv=4, group=2, dqk=16, dv=32, block_size=4, window_left=window, sliding_heads=(2, 4))
    s = make_step(DECODES, headwise=True, release=True, **kw)
    assert (s.table == -1).any()
    run_and_check(s, window_left=window, sliding_heads=(2, 4), sink_kind="learnable")
    s = make_step(DECODES, hkv=2, group=2, dqk=16, dv=16, block_size=8, window_left=window, release=True)
    run_and_check(s, window_left=window)


@pytest.mark.parametrize("block_size", [1, 8, 32, 64])
def test_pages_around_the_key_tile(block_size):
    s = make_step(DECODES, hkv=2, group=2, dqk=16, dv=16, block_size=block_size, seed=block_size)
    run_and_check(s, window_left=50)


@pytest.mark.parametrize("dims", [(24, 40), (192, 128)])
def test_qk_dim_differs_from_v_dim(dims):
    s = make_step(DECODES, hkv=2, group=1, dqk=dims[0], dv=dims[1], block_size=16)
    run_and_check(s, sink_kind="learnable")


@pytest.mark.parametrize("splits", [2, 8])
def test_split_kv(splits):
    reqs = [(300, 1), (5, 1), (129, 1), (0, 1)]
    s = make_step(reqs, hkv=2, group=4, dqk=32, dv=16, block_size=16, window_left=100, release=True)
    run_and_check(s, window_left=100, sink_kind="learnable", num_splits=splits)


def test_tma_loads():
    """The TMA variant (one page per key tile, absent pages read as page 0 and masked)."""
    cfg = tk.TileConfig(block_m=16, block_n=16, use_tma=True)
    reqs = [(70, 1), (33, 1), (100, 1), (5, 1)]
    s = make_step(reqs, hkv=2, group=2, dqk=32, dv=16, block_size=32, window_left=30, release=True)
    run_and_check(s, window_left=30, sink_kind="learnable", decode_config=cfg, num_splits=2)


def test_soft_cap(monkeypatch):
    monkeypatch.setattr(tk, "dense_attention", functools.partial(dense_attention, logits_soft_cap=5.0))
    s = make_step(DECODES, hkv=2, group=4, dqk=16, dv=16, block_size=8, seed=3)
    s.q.mul_(8.0)  # scores well past the cap
    run_and_check(s, logits_soft_cap=5.0, sink_kind="learnable")


def test_decode_rows_of_a_mixed_batch():
    s = make_step([(9, 4), (20, 1), (0, 5), (3, 1)], hkv=2, group=2, dqk=16, dv=16, block_size=8)
    run_and_check(s, window_left=6, sink_kind="learnable")


# on a GPU: gpu_long (the layout is off by default; -m gpu stays under 5 minutes): run with -m gpu_long


@pytest.mark.gpu_long
@gpu
@pytest.mark.parametrize("fmt", ["block_wise_fp8", "fp8_per_channel", "int8"])
@pytest.mark.parametrize("dims", [(128, 128), (64, 64), (192, 128)])
def test_gpu_quantized_decode_and_mixed(fmt, dims):
    kq.test_gpu_decode_and_mixed_bf16(fmt, dims)


@pytest.mark.gpu_long
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_decode_batch(dtype):
    reqs = [(int(c), 1) for c in torch.randint(1, 3000, (24,), generator=torch.Generator().manual_seed(1))]
    kw = dict(window_left=255, sliding_heads=(4, 8))
    s = make_step(reqs, dtype=dtype, headwise=True, release=True, seed=2, **kw, **REAL)
    for splits in (None, 4):
        run_and_check(s, num_splits=splits, sink_kind="learnable", **kw)


def test_switch_takes_key_rows_where_timed_faster(monkeypatch):
    """Unforced (``DECODE_KEY_ROWS`` None), the key-rows decode is the default exactly where it was timed
    faster: block_wise_fp8 caches that are not head-wise, at 128 / 128 and MLA's 192 / 128; not bf16
    caches, head-wise pages, static-scale fp8 or int8 caches, nor other head dims.
    ``FDFLEET_DECODE_KEY_ROWS=0`` turns it off everywhere; a bad value is named. The key-rows setup caps
    128 / 128 caches' GPU tiles at 128 registers and reads e4m3 codes in mode 3 (2 under the
    interpreter) under bf16 and fp16 models."""
    from fastdeploy_paddlefleet.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "DECODE_KEY_ROWS", None)
    monkeypatch.setattr(pa, "default_decode_config", lambda *a, **k: pa.TileConfig(16, 64, 4, 3))

    def plan(kv_quant="block_wise_fp8", dqk=128, dv=128, dtype=torch.bfloat16, hq=8, **kw):
        hkv = 2 if hq == 8 else hq
        kc = torch.zeros(6, hkv, 64, dqk, dtype=torch.uint8)
        vc = torch.zeros(6, hkv, 64, dv, dtype=torch.uint8)
        if kv_quant == "block_wise_fp8":
            scales = dict(key_scale=torch.zeros(6, hkv, 64), value_scale=torch.zeros(6, hkv, 64))
        elif kv_quant is None:
            kc, vc, scales = kc.to(torch.bfloat16), vc.to(torch.bfloat16), {}
        elif kv_quant == "int8":  # static scales per channel
            scales = dict(key_scale=torch.ones(hkv * dqk), value_scale=torch.ones(hkv * dv))
        else:  # a static scale per kv head
            scales = dict(key_scale=torch.ones(hkv), value_scale=torch.ones(hkv))
        q = torch.zeros(4, hq, dqk, dtype=dtype)
        return pa.AttentionPlan(kc, vc, q, scale=0.1, kv_quant=kv_quant, **scales, **kw)

    monkeypatch.delenv("FDFLEET_DECODE_KEY_ROWS", raising=False)
    on = plan()
    assert on.key_rows and on.decode_cfg.maxnreg == pa.FP8_DECODE_AUTO_MAXNREG and on.f16_codes[1] == 2
    assert plan(dtype=torch.float16).f16_codes[1] == 2  # an fp16 model's codes: mode 3 too
    assert plan(dqk=192, dv=128, hq=4).key_rows  # MLA
    for kw in (dict(kv_quant=None), dict(headwise=True), dict(kv_quant="float8_e4m3fn"),
               dict(kv_quant="int8"), dict(dqk=64, dv=64), dict(dqk=256, dv=256)):  # fmt: skip
        assert not plan(**kw).key_rows, kw
    assert pa.key_rows_by_default("block_wise_fp8", False, 128, 128)
    assert not pa.key_rows_by_default("block_wise_fp8", True, 128, 128)
    monkeypatch.setenv("FDFLEET_DECODE_KEY_ROWS", "0")
    off = plan()
    assert not off.key_rows and off.f16_codes[1] == 2  # the query-rows setup of a full 128 / 128 tile
    monkeypatch.setenv("FDFLEET_DECODE_KEY_ROWS", "maybe")
    with pytest.raises(ValueError, match="FDFLEET_DECODE_KEY_ROWS"):
        plan()


def test_a_changed_switch_builds_a_new_plan(monkeypatch):
    """The one-shot wrapper's plan memo keys on the layout's module setting and environment switch (and
    the fp8 decode settings): the same call after a change runs the other layout, not the memoised plan."""
    from fastdeploy_paddlefleet.kernels import paged_attention as pa

    s = make_step(DECODES, hkv=2, group=2, dqk=16, dv=16, block_size=8)
    seen = []
    real = pa.AttentionPlan.__init__

    def record(self, *a, **kw):
        real(self, *a, **kw)
        seen.append(self.key_rows)

    monkeypatch.setattr(pa.AttentionPlan, "__init__", record)
    run_and_check(s)  # forced on by the fixture
    monkeypatch.setattr(pa, "DECODE_KEY_ROWS", False)
    run_and_check(s)
    monkeypatch.setattr(pa, "DECODE_KEY_ROWS", None)
    monkeypatch.setenv("FDFLEET_DECODE_KEY_ROWS", "0")
    run_and_check(s)
    monkeypatch.setattr(pa, "FP8_F16_CODES_DECODE", 1)
    run_and_check(s)
    assert seen == [True, False, False, False]
