"""backends/checks.py: one test per bad-input rule; each error names the argument and its value."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

from fastdeploy_paddlefleet.backends import get_backend  # noqa: E402
from fastdeploy_paddlefleet.backends.checks import validate_inputs  # noqa: E402
from fastdeploy_paddlefleet.plan.layer import LayerAttention  # noqa: E402
from fastdeploy_paddlefleet.runner.batch import build_meta  # noqa: E402

HKV, GROUP, DQK, DV, BS, NB = 2, 2, 16, 8, 4, 4
T = 6  # request 0: 5 cached + 2 new (blocks [2, 0]); request 1: 4 new (block [1])


def layer_(**kw) -> LayerAttention:
    base = dict(
        index=3,
        kind="full",
        num_q_heads=HKV * GROUP,
        num_kv_heads=HKV,
        qk_head_dim=DQK,
        v_head_dim=DV,
        softmax_scale=0.25,
    )
    base.update(kw)
    return LayerAttention(**base)


def meta_(dec=(5, 0), this=(2, 4), tables=((2, 0), (1,)), **kw):
    return build_meta(list(dec), list(this), [list(t) for t in tables], BS, **kw)


def args(**over):
    a = dict(
        q=paddle.zeros([T, HKV * GROUP, DQK]),
        k=paddle.zeros([T, HKV, DQK]),
        v=paddle.zeros([T, HKV, DV]),
        layer=layer_(),
        meta=meta_(),
        kv_cache=(paddle.zeros([NB, HKV, BS, DQK]), paddle.zeros([NB, HKV, BS, DV])),
        sinks=None,
    )
    a.update(over)
    return a


def check(**over):
    return validate_inputs(**args(**over))


def raises(exc, match, **over):
    with pytest.raises(exc, match=match):
        check(**over)


def test_valid_inputs_pass_and_return_host_copy():
    host = check()
    assert host.num_tokens == T and host.batch_size == 2
    assert host.cu_seqlens_q.tolist() == [0, 2, 6]
    assert host.block_tables[0, :2].tolist() == [2, 0]


# q / k / v


def test_q_rank():
    raises(ValueError, r"q must have rank 3.*q.shape=\[6, 64\]", q=paddle.zeros([T, 64]))


def test_q_heads_not_matching_layer():
    raises(ValueError, r"q.shape\[1\] must be 4.*q.shape=\[6, 8, 16\]", q=paddle.zeros([T, 8, DQK]))


def test_q_head_dim():
    raises(ValueError, r"q.shape\[2\] must be 16.*\[6, 4, 32\]", q=paddle.zeros([T, 4, 32]))


def test_k_kv_heads_not_matching_layer():
    raises(ValueError, r"k.shape\[1\] must be 2.*k.shape=\[6, 4, 16\]", k=paddle.zeros([T, 4, DQK]))


def test_v_head_dim():
    raises(ValueError, r"v.shape\[2\] must be 8.*v.shape=\[6, 2, 16\]", v=paddle.zeros([T, HKV, DQK]))


def test_token_count_differs_between_q_and_k():
    raises(ValueError, r"k.shape\[0\] must be 6.*k.shape=\[5, 2, 16\]", k=paddle.zeros([5, HKV, DQK]))


def test_qkv_dtype_mismatch():
    raises(TypeError, r"share one dtype.*k=paddle.float64", k=paddle.zeros([T, HKV, DQK], dtype="float64"))


def test_non_float_dtype():
    raises(
        TypeError, r"q must have a float dtype.*q.dtype=paddle.int32", q=paddle.zeros([T, 4, DQK], "int32")
    )


def test_not_a_tensor():
    raises(TypeError, r"q must be a tensor, got list", q=[[0.0]])


def test_torch_tensors_are_checked_too():
    torch = pytest.importorskip("torch")
    raises(TypeError, r"q must have a float dtype.*torch.int64", q=torch.zeros(T, 4, DQK, dtype=torch.int64))
    raises(ValueError, r"v.shape\[1\] must be 2", v=torch.zeros(T, 3, DV))


# layer / sinks


def test_layer_type():
    raises(TypeError, r"layer must be a LayerAttention, got dict", layer={"index": 0})


def test_layer_heads_not_a_multiple_of_kv_heads():
    with pytest.raises(ValueError, match=r"num_q_heads=3 is not a multiple of num_kv_heads=2"):
        layer_(num_q_heads=3)  # refused where the layer is made, before any backend sees it


def test_learnable_sink_missing():
    raises(ValueError, r"learnable sinks but sinks=None", layer=layer_(sink="learnable"))


def test_learnable_sink_wrong_shape():
    raises(
        ValueError,
        r"sinks must have shape \[4\].*got \[2\]",
        layer=layer_(sink="learnable"),
        sinks=paddle.zeros([2]),
    )


# cache


def test_cache_not_a_pair():
    raises(
        TypeError,
        r"kv_cache must be a \(key_cache, value_cache\) pair, got Tensor",
        kv_cache=paddle.zeros([1]),
    )


def test_cache_rank():
    raises(
        ValueError,
        r"key cache\) must have rank 4.*shape=\[4, 2, 64\]",
        kv_cache=(paddle.zeros([NB, HKV, 64]),) * 2,
    )


def test_cache_kv_heads_not_matching_layer():
    kc = (paddle.zeros([NB, 1, BS, DQK]), paddle.zeros([NB, 1, BS, DV]))
    raises(ValueError, r"key cache\).shape\[1\] must be 2.*\[4, 1, 4, 16\]", kv_cache=kc)


def test_value_cache_dim():
    kc = (paddle.zeros([NB, HKV, BS, DQK]), paddle.zeros([NB, HKV, BS, DQK]))
    raises(ValueError, r"value cache\).shape\[3\] must be 8.*\[4, 2, 4, 16\]", kv_cache=kc)


def test_cache_num_blocks_differ():
    kc = (paddle.zeros([NB, HKV, BS, DQK]), paddle.zeros([NB + 1, HKV, BS, DV]))
    raises(ValueError, r"value cache\).shape\[0\] must be 4", kv_cache=kc)


def test_cache_block_size_not_meta_block_size():
    kc = (paddle.zeros([NB, HKV, 8, DQK]), paddle.zeros([NB, HKV, 8, DV]))
    raises(ValueError, r"key cache\).shape\[2\] must be 4.*\[4, 2, 8, 16\]", kv_cache=kc)


def test_cache_dtype():
    kc = (paddle.zeros([NB, HKV, BS, DQK], "int32"), paddle.zeros([NB, HKV, BS, DV], "int32"))
    raises(TypeError, r"key cache\) must have a float dtype.*int32", kv_cache=kc)
    kc = (paddle.zeros([NB, HKV, BS, DQK]), paddle.zeros([NB, HKV, BS, DV], "float64"))
    raises(TypeError, r"key and value caches must share one dtype.*float32 and paddle.float64", kv_cache=kc)


# metadata


def test_meta_type_and_block_size():
    raises(TypeError, r"meta must be a BatchMeta, got dict", meta={})
    with pytest.raises(ValueError, match=r"meta.block_size=0: expected an int in \[1, "):
        dataclasses.replace(meta_(), block_size=0)  # refused where the metadata is built
    bad = meta_()
    object.__setattr__(bad, "block_size", 0)  # set after construction: the backend still refuses it
    raises(ValueError, r"meta.block_size must be a positive int, got 0", meta=bad)


def test_seq_lens_length():
    m = meta_()
    m.seq_lens_decoder = paddle.to_tensor([5, 0, 0], dtype="int32")
    raises(ValueError, r"meta.seq_lens_decoder must have length 2, got 3: \[5, 0, 0\]", meta=m)


def test_negative_seq_lens():
    m = meta_()
    m.seq_lens_decoder = paddle.to_tensor([-1, 0], dtype="int32")
    raises(ValueError, r"meta.seq_lens_decoder must be >= 0, got \[-1, 0\]", meta=m)


def _with_cu(cu):
    m = meta_()
    m.cu_seqlens_q = paddle.to_tensor(cu, dtype="int32")
    return m


def test_cu_seqlens_length():
    raises(ValueError, r"meta.cu_seqlens_q must have length 3, got 2: \[0, 6\]", meta=_with_cu([0, 6]))


def test_cu_seqlens_start_not_zero():
    raises(ValueError, r"cu_seqlens_q must start at 0.*got \[1, 2, 6\]", meta=_with_cu([1, 2, 6]))


def test_cu_seqlens_decreasing():
    raises(
        ValueError, r"cu_seqlens_q must start at 0, not decrease.*got \[0, 4, 2\]", meta=_with_cu([0, 4, 2])
    )


def test_cu_seqlens_last_not_token_count():
    raises(ValueError, r"token count T=6, got \[0, 2, 7\]", meta=_with_cu([0, 2, 7]))


def test_cu_seqlens_not_matching_seq_lens_this_time():
    raises(
        ValueError,
        r"cu_seqlens_q=\[0, 3, 6\] does not match meta.seq_lens_this_time=\[2, 4\]",
        meta=_with_cu([0, 3, 6]),
    )


def test_batch_id_per_token_length():
    m = meta_()
    m.batch_id_per_token = paddle.to_tensor([0, 0, 1], dtype="int32")
    raises(ValueError, r"meta.batch_id_per_token must have length 6, got 3", meta=m)


def test_batch_id_per_token_values():
    m = meta_()
    m.batch_id_per_token = paddle.to_tensor([0, 1, 1, 1, 1, 1], dtype="int32")
    raises(ValueError, r"batch_id_per_token=\[0, 1, 1, 1, 1, 1\] does not match", meta=m)


def test_host_maxima_understated():
    m = dataclasses.replace(meta_(), max_seq_len_this_time=3)
    raises(ValueError, r"meta.max_seq_len_this_time=3 is below this step's maximum 4", meta=m)
    m = dataclasses.replace(meta_(), max_context_len=6)
    raises(ValueError, r"meta.max_context_len=6 is below this step's maximum 7", meta=m)
    check(meta=dataclasses.replace(meta_(), max_seq_len_this_time=None, max_context_len=None))


def test_block_table_too_short():
    # request 0 has 7 tokens after this step: 2 blocks of 4, the table has 1 column
    m = meta_(dec=(5, 0), this=(2, 1), tables=((2,), (1,)))
    raises(
        ValueError,
        r"meta.block_tables is too short: row 0 needs 2 columns, the table has 1",
        meta=m,
        **_tokens(3),
    )


def _tokens(t):
    return dict(q=paddle.zeros([t, 4, DQK]), k=paddle.zeros([t, HKV, DQK]), v=paddle.zeros([t, HKV, DV]))


def test_block_id_out_of_range():
    raises(
        ValueError,
        r"meta.block_tables\[0, 1\] = 4 is out of range \[0, 4\)",
        meta=meta_(tables=((2, 4), (1,))),
    )
    raises(ValueError, r"meta.block_tables\[1, 0\] = -2 is out of range", meta=meta_(tables=((2, 0), (-2,))))


def test_minus_one_for_a_block_written():
    raises(
        ValueError,
        r"meta.block_tables\[0, 1\] = -1 is a -1 \(block not there\)",
        meta=meta_(tables=((2, -1), (1,))),
    )


def test_minus_one_for_a_block_read():
    # request 0's tokens 0..3 (block 0) are context a full layer reads
    raises(
        ValueError,
        r"meta.block_tables\[0, 0\] = -1 is a -1.*read or written",
        meta=meta_(tables=((-1, 0), (1,))),
    )


def test_minus_one_outside_the_window_is_fine():
    """A sliding layer (window 1) at positions 5, 6 reads from position 4 on: block 0 may be gone."""
    sliding = layer_(kind="sliding", window_left=1, sliding_kv_heads=(0, HKV))
    check(layer=sliding, meta=meta_(tables=((-1, 0), (1,))))
    wide = layer_(kind="sliding", window_left=2, sliding_kv_heads=(0, HKV))  # reads position 3: block 0
    raises(ValueError, r"meta.block_tables\[0, 0\] = -1", layer=wide, meta=meta_(tables=((-1, 0), (1,))))


def test_idle_slot_needs_no_blocks():
    check(meta=meta_(dec=(5, 9), this=(6, 0), tables=((2, 0, 3), ())), **_tokens(6))


# head-wise page tables (page = block * Hkv + head)


def _headwise_layer():
    return layer_(kind="headwise", window_left=1, sliding_kv_heads=(1, HKV))


def _pages(rows):
    return paddle.to_tensor(np.array(rows, dtype="int32"))


GOOD_PAGES = [[4, 0], [5, 1], [2, -1], [3, -1]]  # rows b * Hkv + h


def test_headwise_table_valid_and_as_mapping():
    check(layer=_headwise_layer(), meta=meta_(block_tables_headwise=_pages(GOOD_PAGES)))
    check(layer=_headwise_layer(), meta=meta_(block_tables_headwise={3: _pages(GOOD_PAGES)}))


def test_headwise_table_rows():
    m = meta_(block_tables_headwise=_pages(GOOD_PAGES[:3]))
    raises(
        ValueError,
        r"head-wise table of layer 3 must have shape \[bsz \* Hkv = 4, max_pages\], got \[3, 2\]",
        meta=m,
    )


def test_headwise_page_out_of_range():
    m = meta_(block_tables_headwise=_pages([[4, 0], [5, 8], [2, -1], [3, -1]]))
    raises(ValueError, r"block_tables_headwise \(layer 3\)\[1, 1\] = 8 is out of range \[0, 8\)", meta=m)


def test_headwise_minus_one_page_in_window():
    # the full head 0 of request 0 reads its block 0
    m = meta_(block_tables_headwise=_pages([[-1, 0], [-1, 1], [2, -1], [3, -1]]))
    raises(ValueError, r"block_tables_headwise \(layer 3\)\[0, 0\] = -1", layer=_headwise_layer(), meta=m)
    # the sliding head 1 (window 1, queries at 5, 6) does not read block 0
    m = meta_(block_tables_headwise=_pages([[4, 0], [-1, 1], [2, -1], [3, -1]]))
    check(layer=_headwise_layer(), meta=m)


def test_headwise_table_too_short():
    m = meta_(block_tables_headwise=_pages([[4], [5], [2], [3]]))
    raises(ValueError, r"block_tables_headwise \(layer 3\) is too short: row 0 needs 2 columns", meta=m)


def test_backend_raises_the_same_errors():
    backend = get_backend("reference")
    a = args(q=paddle.zeros([T, 8, DQK]))
    with pytest.raises(ValueError, match=r"q.shape\[1\] must be 4"):
        backend.forward(**a)


def test_metadata_is_copied_to_the_host_once_per_step(monkeypatch):
    """Every layer of a step shares one BatchMeta: its host copies are made once, not per layer,
    and a field replaced on the object is copied again."""
    from fastdeploy_paddlefleet.backends import checks

    calls = []
    real = checks.to_numpy
    monkeypatch.setattr(checks, "to_numpy", lambda x: calls.append(1) or real(x))
    a = args()
    validate_inputs(**a)
    first = len(calls)
    assert first > 0
    for index in range(4):  # more layers, same step
        validate_inputs(**dict(a, layer=layer_(index=index)))
    assert len(calls) == first
    a["meta"].seq_lens_decoder = paddle.to_tensor([5, 0], dtype="int32")
    validate_inputs(**a)
    assert len(calls) == first + 1


def test_served_checks_read_no_metadata_values(monkeypatch):
    """Served mode (``validate_shapes``) keeps to dtypes, shapes, strides and identity: with int32
    metadata it never copies a value to the host (that would be a device sync per layer on a GPU)."""
    from fastdeploy_paddlefleet.backends import checks

    def no_copy(x):
        raise AssertionError("validate_shapes read metadata values")

    monkeypatch.setattr(checks, "to_numpy", no_copy)
    for index in range(3):
        checks.validate_shapes(**dict(args(), layer=layer_(index=index)))
    with pytest.raises(AssertionError, match="read metadata values"):  # the checked mode does read them
        check()
