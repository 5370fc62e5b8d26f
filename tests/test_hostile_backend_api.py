"""Hostile inputs to the backend API: impossible ``LayerAttention`` values, numpy or float inputs, write
collisions and aliased pages. Every one is a ``TypeError`` / ``ValueError`` naming the field, before
a kernel runs (no paddle-internal error, no silent truncation, no silent corruption of the cache).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

from fastdeploy_paddlefleet.backends import get_backend  # noqa: E402
from fastdeploy_paddlefleet.backends.base import BatchMeta  # noqa: E402
from fastdeploy_paddlefleet.backends.checks import validate_inputs  # noqa: E402
from fastdeploy_paddlefleet.plan.layer import LayerAttention, MLADims  # noqa: E402
from fastdeploy_paddlefleet.runner.batch import build_meta  # noqa: E402

HKV, GROUP, D, BS, NB = 2, 2, 8, 4, 6


def layer_(**kw) -> LayerAttention:
    base = dict(index=0, kind="full", num_q_heads=HKV * GROUP, num_kv_heads=HKV, qk_head_dim=D, v_head_dim=D)
    base["softmax_scale"] = 0.5
    base.update(kw)
    return LayerAttention(**base)


# ---- LayerAttention ---------------------------------------------------------------------------

LAYERS = [
    (dict(kind="diagonal"), ValueError, "kind='diagonal'"),
    (dict(sink="softmax+1"), ValueError, "sink='softmax\\+1'"),  # an unknown sink kind was accepted
    (dict(softmax_scale=math.nan), ValueError, "softmax_scale=nan"),  # a NaN scale was accepted
    (dict(softmax_scale=math.inf), ValueError, "softmax_scale=inf"),
    (dict(softmax_scale=0.0), ValueError, "softmax_scale=0.0"),
    (dict(softmax_scale=-1.0), ValueError, "softmax_scale=-1.0"),
    (dict(softmax_scale=True), TypeError, "softmax_scale=True"),
    (dict(softmax_scale="0.5"), TypeError, "softmax_scale='0.5'"),
    (dict(logits_soft_cap=math.nan), ValueError, "logits_soft_cap=nan"),
    (dict(kind="sliding"), ValueError, "needs window_left"),  # a sliding layer without a window
    (dict(kind="sliding", window_left=4), ValueError, "needs sliding_kv_heads"),
    (dict(kind="headwise", window_left=4), ValueError, "needs sliding_kv_heads"),
    (
        dict(kind="sliding", window_left=-5, sliding_kv_heads=(0, 2)),
        ValueError,
        "window_left=-5",
    ),  # paddle error
    (dict(kind="sliding", window_left=True, sliding_kv_heads=(0, 2)), TypeError, "window_left=True"),
    (dict(kind="sliding", window_left=4.0, sliding_kv_heads=(0, 2)), TypeError, "window_left=4.0"),
    (dict(kind="headwise", window_left=4, sliding_kv_heads=(1, 5)), ValueError, r"sliding_kv_heads=\(1, 5\)"),
    (dict(kind="headwise", window_left=4, sliding_kv_heads=(2, 1)), ValueError, "sliding_kv_heads"),
    (dict(kind="headwise", window_left=4, sliding_kv_heads=(-1, 2)), ValueError, "sliding_kv_heads"),
    (dict(kind="headwise", window_left=4, sliding_kv_heads=[1, 2]), TypeError, "sliding_kv_heads"),
    (dict(sliding_kv_heads=(0, 2)), ValueError, "a full layer has no sliding_kv_heads"),
    (dict(num_q_heads=3), ValueError, "num_q_heads=3 is not a multiple of num_kv_heads=2"),
    (dict(num_q_heads=0), ValueError, "num_q_heads=0"),
    (dict(num_kv_heads=0), ValueError, "num_kv_heads=0"),
    (dict(num_kv_heads=2.0), TypeError, "num_kv_heads=2.0"),
    (dict(qk_head_dim=0), ValueError, "qk_head_dim=0"),
    (dict(v_head_dim=-8), ValueError, "v_head_dim=-8"),
    (dict(index=-1), ValueError, "index=-1"),
    (dict(index="0"), TypeError, "index='0'"),
    (dict(mla=(1, 2, 3)), TypeError, "mla="),
    (dict(kv_head_range=(3, 1)), ValueError, "kv_head_range"),
    (dict(q_head_range=(0, -4)), ValueError, "q_head_range"),
]


@pytest.mark.parametrize(("kw", "exc", "match"), LAYERS, ids=[str(k)[:50] for k, _, _ in LAYERS])
def test_impossible_layers_are_refused_at_construction(kw, exc, match):
    with pytest.raises(exc, match=match):
        layer_(**kw)


def test_valid_edge_layers_still_build():
    layer_(kind="sliding", window_left=0, sliding_kv_heads=(0, HKV))  # a token sees only itself
    layer_(kind="headwise", window_left=3, sliding_kv_heads=(1, 2))
    layer_(mla=MLADims(16, 8, 4), q_head_range=(4, 8), kv_head_range=(2, 4), logits_soft_cap=30.0)
    layer_(softmax_scale=np.float32(0.125))  # a numpy scale is a number


# ---- a step's inputs --------------------------------------------------------------------------


def step(dec=(5, 0), this=(2, 4), tables=((2, 0), (1,)), layer=None, **meta_kw):
    t = sum(this)
    layer = layer or layer_()
    return dict(
        q=paddle.zeros([t, HKV * GROUP, D]),
        k=paddle.zeros([t, HKV, D]),
        v=paddle.zeros([t, HKV, D]),
        layer=layer,
        meta=build_meta(list(dec), list(this), [list(x) for x in tables], BS, **meta_kw),
        kv_cache=(paddle.zeros([NB, HKV, BS, D]), paddle.zeros([NB, HKV, BS, D])),
    )


def test_a_valid_step_passes():
    validate_inputs(**step())


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_numpy_inputs_are_named(name):
    """numpy q/k/v into the reference backend gave 'Cannot interpret <DataType.FLOAT32> as a data type'."""
    a = step()
    a[name] = a[name].numpy()
    with pytest.raises(TypeError, match=f"{name} must be a paddle or torch tensor, got numpy.ndarray"):
        get_backend("reference").forward(**a)


def test_fp32_inputs_into_bf16_caches_are_refused_not_rounded():
    """The reference backend cast fp32 q/k/v into bf16 caches where the Triton backend refuses:
    both refuse now, by name, before anything is written."""
    a = step()
    a["kv_cache"] = tuple(c.astype("bfloat16") for c in a["kv_cache"])
    before = [c.astype("float32").numpy().copy() for c in a["kv_cache"]]
    a["k"] = paddle.ones_like(a["k"])
    with pytest.raises(
        TypeError, match=r"kv_cache dtype must match q \(paddle.float32\), got paddle.bfloat16"
    ):
        get_backend("reference").forward(**a)
    for cache, old in zip(a["kv_cache"], before, strict=True):
        assert np.array_equal(cache.astype("float32").numpy(), old)


def test_numpy_cache_is_named():
    a = step()
    a["kv_cache"] = (a["kv_cache"][0].numpy(), a["kv_cache"][1])
    with pytest.raises(TypeError, match=r"kv_cache\[0\] \(key cache\) must be a paddle or torch tensor"):
        validate_inputs(**a)


@pytest.mark.parametrize(
    "field",
    ["seq_lens_decoder", "seq_lens_this_time", "seq_lens_encoder", "cu_seqlens_q", "batch_id_per_token"],
)
def test_float_metadata_is_refused_not_truncated(field):
    a = step()
    x = getattr(a["meta"], field).astype("float32")
    a["meta"] = dataclasses.replace(a["meta"], **{field: x})
    with pytest.raises(TypeError, match=f"meta.{field} must hold integers"):
        validate_inputs(**a)


def test_float_block_table_2_7_is_refused_not_read_as_2():
    a = step()
    a["meta"] = dataclasses.replace(a["meta"], block_tables=paddle.to_tensor([[2.7, 0.0], [1.0, 0.0]]))
    with pytest.raises(TypeError, match="meta.block_tables must hold integers"):
        validate_inputs(**a)


def test_float_headwise_table_is_refused():
    hw = np.arange(4 * 3, dtype=np.float64).reshape(4, 3)
    a = step(dec=(5, 0), this=(2, 4), tables=((0, 0), (0,)))
    a["meta"] = dataclasses.replace(a["meta"], block_tables_headwise=hw)
    with pytest.raises(TypeError, match="meta.block_tables_headwise must hold integers"):
        validate_inputs(**a)


def test_bool_block_size_is_refused():
    a = step()
    with pytest.raises(TypeError, match="meta.block_size=True: expected an int, got bool"):
        dataclasses.replace(a["meta"], block_size=True)  # refused where the metadata is built
    object.__setattr__(a["meta"], "block_size", True)  # set after construction: the backend refuses it
    with pytest.raises(ValueError, match="block_size"):
        validate_inputs(**a)


# ---- write collisions and aliased pages ---------------------------------------------------------


def test_two_requests_writing_one_block_slot_collide():
    """Both requests write physical block 1 slot 0 this step: the second would overwrite the first."""
    with pytest.raises(ValueError, match="write collision.*block 1 slot 0"):
        validate_inputs(**step(dec=(0, 0), this=(2, 2), tables=((1,), (1,))))


def test_same_block_different_slots_still_collide_by_slot_only():
    """Request 0 writes slots 0-1 of block 3, request 1 (4 cached) writes slot 0 of block 3 too."""
    with pytest.raises(ValueError, match="write collision.*block 3 slot 0"):
        validate_inputs(**step(dec=(0, 4), this=(2, 1), tables=((3,), (1, 3))))


def test_a_shared_read_only_prefix_block_is_fine():
    """Prefix caching: two requests read block 0, each writes its own block."""
    validate_inputs(**step(dec=(4, 4), this=(1, 1), tables=((0, 1), (0, 2))))


def headwise_step(pages, dec=(4, 4), this=(1, 1)):
    """One head-wise layer (head 1 slides, window 2); ``pages`` ``[bsz * Hkv, max_pages]``."""
    layer = layer_(kind="headwise", window_left=2, sliding_kv_heads=(1, 2))
    return step(
        dec=dec,
        this=this,
        tables=((0, 0), (0, 0)),
        layer=layer,
        block_tables_headwise=np.asarray(pages, dtype=np.int32),
    )


def test_headwise_two_heads_mapped_to_one_page():
    """Request 0's kv head 1 and request 1's kv head 0 both read page 2: one holds the other's keys."""
    with pytest.raises(
        ValueError, match="page 2 is mapped to row 1 \\(kv head 1\\) and row 2 \\(kv head 0\\)"
    ):
        validate_inputs(**headwise_step([[1, 0], [2, 3], [2, 7], [6, 4]]))


def test_headwise_two_heads_of_one_request_on_one_page():
    with pytest.raises(ValueError, match="page 5"):
        validate_inputs(**headwise_step([[5, 0], [5, 3], [8, 7], [6, 4]]))


def test_headwise_one_page_twice_in_one_row():
    with pytest.raises(ValueError, match="page 9"):
        validate_inputs(**headwise_step([[9, 9], [2, 3], [8, 7], [6, 4]]))


def test_headwise_write_collision_across_requests():
    """Both requests' kv head 0 write slot 0 of page 0 (a fresh prefill each)."""
    with pytest.raises(ValueError, match="write collision.*page 0 slot 0"):
        validate_inputs(**headwise_step([[0], [1], [0], [3]], dec=(0, 0), this=(1, 1)))


def test_headwise_shared_prefix_page_of_the_same_head_is_fine():
    validate_inputs(**headwise_step([[1, 0], [2, 3], [1, 7], [6, 4]]))


def test_headwise_released_pages_are_not_aliasing():
    """-1 entries (released blocks of the sliding head 1, out of its window) repeat freely."""
    pages = [[1, 0, 10], [-1, 3, 11], [5, 7, 2], [-1, 4, 6]]  # position 8 sees 6..8: block 0 is gone
    validate_inputs(**headwise_step(pages, dec=(8, 8)))


def test_collisions_are_checked_once_per_step_and_table():
    """Layers of a step share the check (memoized on the BatchMeta), not recomputed per layer."""
    a = step()
    validate_inputs(**a)
    done = a["meta"].__dict__["_aliasing_checked"]
    assert len(done) == 1
    validate_inputs(**a)
    assert len(done) == 1


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="'cuda'"):
        get_backend("cuda")


def test_meta_of_the_wrong_type():
    a = step()
    a["meta"] = dataclasses.asdict(a["meta"])
    with pytest.raises(TypeError, match="meta must be a BatchMeta"):
        validate_inputs(**a)
    assert BatchMeta  # the public type the message names
