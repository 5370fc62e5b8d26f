"""Silent accepts on the served path become named errors (issue 30 item 5).

A hostile tester found values the plugin took without a word: a token id -1 or ``vocab_size``
embedded (paddle's CPU embedding reads memory before the table for -1), float token ids and a
``block_size`` of 4.7 truncated, an ``int8`` model built, ``seq_lens_decoder = -3`` served as
zeros, a ``KVDelta`` with logical block -1 / unit -7 applied (and a refused one left half
written), the manager's ``computed`` bound moving backwards, ``max_context_len`` NaN / inf /
negative / zero / 7.5 accepted, ``lookahead_tokens`` unchecked. Each is refused here by name;
a refusal changes nothing. Expected values are written out here, never read back from the code.

Paddle-free checks run everywhere; the ones that build a model or tensors skip without paddle.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest

from fastdeploy_paddlefleet.backends.base import BatchMeta
from fastdeploy_paddlefleet.kvcache.headwise import (
    HeadwiseKVManager,
    groups_from_plan,
    pool_demand,
    size_pools,
)
from fastdeploy_paddlefleet.kvcache.pools import fastdeploy_lookahead
from fastdeploy_paddlefleet.plan.layer import AttentionPlan, LayerAttention
from fastdeploy_paddlefleet.serving.kv_recycling.protocol import KVDelta, LaneTables, layout_from_plans


def layer(i: int, hkv: int, first: int | None, w: int | None) -> LayerAttention:
    kind = "full" if first is None else ("sliding" if first == 0 else "headwise")
    return LayerAttention(
        i,
        kind,
        2 * hkv,
        hkv,
        8,
        8,
        1.0,
        window_left=w,
        sliding_kv_heads=None if first is None else (first, hkv),
    )


# one full layer and one head-wise layer (kv head 1 slides): group 0 one lane, group 1 two lanes
PLAN = AttentionPlan((layer(0, 2, None, None), layer(1, 2, 1, 3)))


def paddle_or_skip():
    return pytest.importorskip("paddle", reason="needs Paddle (the CPU build in CI)")


# ---- 1. token ids outside [0, vocab_size), 2. float token ids ----------------------------------


def tiny_wrapper(block_size: int = 4):
    paddle_or_skip()
    from fastdeploy_paddlefleet.minifleet import build_minifleet
    from fastdeploy_paddlefleet.plan import plan_from_config
    from fastdeploy_paddlefleet.serving.model import PaddleFleetForCausalLM

    model = build_minifleet("tiny", seed=1)
    return PaddleFleetForCausalLM.from_model(model, plan_from_config(model.config), backend="reference")


def one_request_step(wrapper, n: int = 2, **overrides):
    """A valid one-request prefill step of ``n`` tokens on a fresh one-block-per-layer cache."""
    import paddle

    from fastdeploy_paddlefleet.patch import cache_plan

    caches = []
    for la in cache_plan(wrapper.plan, wrapper.backend):
        shape = [2, la.num_kv_heads, 4]
        caches += [paddle.zeros(shape + [la.qk_head_dim]), paddle.zeros(shape + [la.v_head_dim])]
    meta = dict(
        seq_lens_encoder=paddle.to_tensor([n], dtype="int32"),
        seq_lens_decoder=paddle.to_tensor([0], dtype="int32"),
        seq_lens_this_time=paddle.to_tensor([n], dtype="int32"),
        cu_seqlens_q=paddle.to_tensor([0, n], dtype="int32"),
        batch_id_per_token=paddle.to_tensor([0] * n, dtype="int32"),
        block_tables=paddle.to_tensor([[0, 1]], dtype="int32"),
        caches=caches,
        block_size=4,
    )
    meta.update(overrides)
    return SimpleNamespace(**meta)


VOCAB = 256  # the tiny preset's vocab_size


@pytest.mark.parametrize("bad", [-1, VOCAB, VOCAB + 7, -(2**40)])
def test_served_forward_refuses_a_token_id_outside_the_vocab(bad):
    import numpy as np

    wrapper = tiny_wrapper()
    paddle = paddle_or_skip()
    ids = paddle.to_tensor(np.array([3, bad], "int64"))
    with pytest.raises(ValueError, match=rf"ids_remove_padding'\]\[1\] = {bad} .*vocab_size={VOCAB}\)"):
        wrapper({"ids_remove_padding": ids}, one_request_step(wrapper))
    ok = wrapper(
        {"ids_remove_padding": paddle.to_tensor([3, VOCAB - 1], dtype="int64")}, one_request_step(wrapper)
    )
    assert list(ok.shape) == [2, 64] and bool(paddle.isfinite(ok).all())


@pytest.mark.parametrize("dtype", ["float32", "float64", "bool"])
def test_served_forward_refuses_float_and_bool_token_ids(dtype):
    wrapper = tiny_wrapper()
    paddle = paddle_or_skip()
    ids = paddle.to_tensor([1.7, 2.0]).astype(dtype)
    with pytest.raises(
        TypeError, match=f"ids_remove_padding'\\] must hold integer token ids, got dtype {dtype}"
    ):
        wrapper({"ids_remove_padding": ids}, one_request_step(wrapper))


@pytest.mark.parametrize("bad", [-1, VOCAB])
def test_minifleet_forward_refuses_a_token_id_outside_the_vocab(bad):
    paddle = paddle_or_skip()
    from fastdeploy_paddlefleet.minifleet import build_minifleet

    model = build_minifleet("tiny", seed=1)
    with pytest.raises(ValueError, match=rf"input_ids\[0, 2\] = {bad} .*vocab_size={VOCAB}\)"):
        model(paddle.to_tensor([[5, 6, bad]], dtype="int64"))
    with pytest.raises(TypeError, match="input_ids must hold integer token ids, got dtype paddle.float32"):
        model(paddle.to_tensor([[5.0, 1.7]]))


def test_minifleet_mtp_layer_refuses_a_token_id_outside_the_vocab():
    paddle = paddle_or_skip()
    from fastdeploy_paddlefleet.minifleet import build_minifleet
    from fastdeploy_paddlefleet.presets import load_preset

    cfg = load_preset("tiny")
    freq = cfg.get("window_attn_skip_freq")
    cfg.update(mtp_num_layers=1, **({"window_attn_skip_freq": [*freq, 0]} if isinstance(freq, list) else {}))
    model = build_minifleet(cfg, seed=1)
    mtp = model.mtp[0]
    x = {
        "input_ids": paddle.to_tensor([[1, VOCAB]], dtype="int64"),
        "hidden_states": paddle.zeros([1, 2, 64]),
    }
    with pytest.raises(
        ValueError, match=rf"input_ids \(MTP layer 0\)\[0, 1\] = {VOCAB} .*vocab_size={VOCAB}\)"
    ):
        mtp(x)


def test_check_token_ids_on_host_values():
    np = pytest.importorskip("numpy")
    from fastdeploy_paddlefleet.backends.checks import check_token_ids

    check_token_ids("ids", np.array([0, 9]), 10)
    with pytest.raises(
        ValueError, match=r"ids\[2\] = 10 is not a token id: expected an int in \[0, vocab_size=10\)"
    ):
        check_token_ids("ids", np.array([0, 9, 10]), 10)
    with pytest.raises(TypeError, match="ids must hold integer token ids, got dtype float64"):
        check_token_ids("ids", [1.7], 10)


# ---- 2. block_size 4.7 and other integer fields ------------------------------------------------


@pytest.mark.parametrize(
    ("value", "exc", "match"),
    [
        (4.7, TypeError, "meta.block_size=4.7: expected an int, got float"),
        (4.0, TypeError, "meta.block_size=4.0: expected an int, got float"),
        (True, TypeError, "meta.block_size=True: expected an int, got bool"),
        ("4", TypeError, "meta.block_size='4': expected an int, got str"),
        (0, ValueError, r"meta.block_size=0: expected an int in \[1, "),
    ],
)
def test_batch_meta_refuses_a_non_integer_block_size(value, exc, match):
    with pytest.raises(exc, match=match):
        BatchMeta([1], [0], [1], [0, 1], [0], [[0]], block_size=value)


def test_forward_meta_block_size_4_7_is_refused_not_truncated():
    wrapper = tiny_wrapper()
    from fastdeploy_paddlefleet.serving.forward_meta import batch_meta_from_forward_meta

    step = one_request_step(wrapper)
    with pytest.raises(TypeError, match=r"forward_meta.block_size=4.7: expected an int"):
        batch_meta_from_forward_meta(SimpleNamespace(**{**vars(step), "block_size": 4.7}), None, 2)
    with pytest.raises(TypeError, match=r"block_size \(argument\)=4.7"):
        batch_meta_from_forward_meta(step, 4.7, 2)
    with pytest.raises(TypeError, match=r"block_size=4.7: expected an int"):
        type(wrapper).from_model(wrapper.model, wrapper.plan, backend="reference", block_size=4.7)


def test_runner_build_meta_refuses_float_lengths():
    paddle_or_skip()
    from fastdeploy_paddlefleet.runner.batch import build_meta

    with pytest.raises(TypeError, match=r"seq_lens_this_time\[1\]=1.7: expected an int"):
        build_meta([0, 0], [2, 1.7], [[0], [1]], 4)
    with pytest.raises(TypeError, match=r"seq_lens_decoder\[0\]=True"):
        build_meta([True], [1], [[0]], 4)
    meta = build_meta([3], [1], [[0]], 4)  # a decode step: context 4
    assert (meta.max_seq_len_this_time, meta.max_context_len, meta.block_size) == (1, 4, 4)


def fd_config(**sections):
    base = {
        "model_config": {"dtype": "bfloat16", "seed": 0},
        "parallel_config": {"tensor_parallel_size": 1, "tensor_parallel_rank": 0, "expert_parallel_size": 1},
        "cache_config": {"block_size": 64},
    }
    for section, fields in sections.items():
        base.setdefault(section, {}).update(fields)
    return base


@pytest.mark.parametrize(
    ("section", "name", "value", "exc"),
    [
        ("cache_config", "block_size", 4.7, TypeError),
        ("cache_config", "block_size", True, TypeError),
        ("cache_config", "block_size", 0, ValueError),
        ("parallel_config", "tensor_parallel_size", 2.5, TypeError),
        ("parallel_config", "tensor_parallel_rank", -1, ValueError),
        ("parallel_config", "expert_parallel_size", True, TypeError),
        ("model_config", "seed", 1.5, TypeError),
        ("speculative_config", "num_speculative_tokens", 2.5, TypeError),
    ],
)
def test_integer_fastdeploy_settings_are_refused_by_name(section, name, value, exc):
    from fastdeploy_paddlefleet.serving.checks import check_fd_config

    with pytest.raises(exc, match=rf"X: {section}.{name}={value!r}"):
        check_fd_config(fd_config(**{section: {name: value}}), "X")
    check_fd_config(fd_config(), "X")  # the valid settings pass


# ---- 3. a non-float model dtype ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["int8", "int32", "uint8", "float64", "fp8", 8])
def test_fastdeploy_model_dtype_must_be_a_served_float(dtype):
    from fastdeploy_paddlefleet.serving.checks import check_fd_config

    with pytest.raises(ValueError, match=rf"model_config.dtype={dtype!r} .*float32, float16, bfloat16"):
        check_fd_config(fd_config(model_config={"dtype": dtype}), "X")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_served_float_dtypes_pass(dtype):
    from fastdeploy_paddlefleet.serving.checks import check_fd_config

    check_fd_config(fd_config(model_config={"dtype": dtype}), "X")


def test_an_int8_model_is_refused_before_it_is_built(tmp_path):
    paddle_or_skip()
    import json

    from fastdeploy_paddlefleet.minifleet import build_minifleet
    from fastdeploy_paddlefleet.presets import load_preset
    from fastdeploy_paddlefleet.serving.model import PaddleFleetForCausalLM

    (tmp_path / "config.json").write_text(json.dumps(load_preset("tiny")))
    cfg = SimpleNamespace(
        model_config=SimpleNamespace(model=str(tmp_path), dtype="int8", seed=1),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, tensor_parallel_rank=0, expert_parallel_size=1
        ),
        cache_config=SimpleNamespace(block_size=4),
    )
    with pytest.raises(ValueError, match="model_config.dtype='int8'"):
        PaddleFleetForCausalLM(cfg)
    with pytest.raises(ValueError, match=r"dtype='int8': minifleet builds float models only"):
        build_minifleet("tiny", dtype="int8")
    import paddle

    model = build_minifleet("tiny", dtype=paddle.float32)  # a paddle dtype object is fine
    assert model.embedding.word_embeddings.weight.dtype == paddle.float32


# ---- 4. negative sequence lengths --------------------------------------------------------------


@pytest.mark.parametrize("field", ["seq_lens_decoder", "seq_lens_encoder", "seq_lens_this_time"])
def test_negative_seq_lens_are_refused_where_the_host_holds_them(field):
    wrapper = tiny_wrapper()
    paddle = paddle_or_skip()
    from fastdeploy_paddlefleet.serving.forward_meta import batch_meta_from_forward_meta

    step = one_request_step(wrapper, **{field: paddle.to_tensor([-3], dtype="int32")})
    with pytest.raises(ValueError, match=rf"forward_meta.{field}\[0\] = -3: sequence lengths must be >= 0"):
        batch_meta_from_forward_meta(step, None, 2)
    ids = paddle.to_tensor([1, 2], dtype="int64")
    with pytest.raises(ValueError, match=rf"forward_meta.{field}\[0\] = -3"):
        wrapper({"ids_remove_padding": ids}, step)
    import numpy as np

    listed = one_request_step(wrapper, **{field: np.array([[-3]], "int32")})  # FastDeploy's [bsz, 1]
    with pytest.raises(ValueError, match=rf"forward_meta.{field}\[0\] = -3"):
        batch_meta_from_forward_meta(listed, None, 2)


def test_checked_mode_refuses_a_negative_seq_lens_encoder():
    paddle = paddle_or_skip()
    import numpy as np

    from fastdeploy_paddlefleet.backends.checks import validate_inputs

    la = layer(0, 2, None, None)
    meta = BatchMeta(
        seq_lens_encoder=np.array([-1], "int32"),
        seq_lens_decoder=np.array([0], "int32"),
        seq_lens_this_time=np.array([1], "int32"),
        cu_seqlens_q=np.array([0, 1], "int32"),
        batch_id_per_token=np.array([0], "int32"),
        block_tables=np.array([[0]], "int32"),
        block_size=4,
    )
    q = paddle.zeros([1, 4, 8])
    kv = paddle.zeros([1, 2, 8])
    cache = (paddle.zeros([1, 2, 4, 8]), paddle.zeros([1, 2, 4, 8]))
    with pytest.raises(ValueError, match=r"meta.seq_lens_encoder must be >= 0, got \[-1\]"):
        validate_inputs(q, kv, kv, la, meta, cache)


# ---- 5. KVDelta changes checked whole before any write -----------------------------------------


LAYOUT = layout_from_plans(PLAN, 4)


def delta(seq, changes, num_blocks=2, reset=False, rid="r"):
    return KVDelta(rid, seq, reset, num_blocks, tuple(changes), LAYOUT.layout_id)


def seeded_tables() -> LaneTables:
    t = LaneTables(LAYOUT)
    lanes = [len(g.lanes) for g in LAYOUT.groups]
    assert lanes == [2, 2]  # one page per kv head (the head-wise group's unit): two lanes each
    t.apply(delta(1, [(0, 0, 0, 5), (0, 1, 0, 8), (1, 0, 0, 6), (1, 1, 0, 7)], num_blocks=1, reset=True))
    t.apply(delta(1, [(0, 0, 0, 9)], num_blocks=1, reset=True, rid="other"))
    return t


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ((0, 0, -1, 3), r"logical_block=-1 is outside \[0, num_blocks=2\)"),
        ((0, 0, 2, -1), r"logical_block=2 is outside \[0, num_blocks=2\)"),
        ((0, 0, 10**12, -1), r"logical_block=1000000000000 is outside"),
        ((0, 0, 1, -7), r"unit_id=-7 is outside \[-1, "),
        ((0, 0, 1, 2**31), r"unit_id=2147483648 is outside \[-1, "),
        ((2, 0, 1, 3), r"group=2 is outside \[0, 2\)"),
        ((-1, 0, 1, 3), r"group=-1 is outside \[0, 2\)"),
        ((0, 2, 1, 3), r"lane=2 is outside \[0, 2\) of group 0"),
        ((0, -1, 1, 3), r"lane=-1 is outside \[0, 2\) of group 0"),
        ((1, 2, 1, 3), r"lane=2 is outside \[0, 2\) of group 1"),
    ],
)
def test_a_bad_change_refuses_the_whole_delta_and_writes_nothing(change, match):
    t = seeded_tables()
    before = copy.deepcopy((t.rows, t.last_seq))
    good = [(0, 0, 1, 11), (1, 0, 1, 12), (1, 1, 0, -1)]  # valid changes BEFORE the bad one
    with pytest.raises(ValueError, match=r"delta for 'r' \(seq=2\), change 3 .*" + match):
        t.apply(delta(2, [*good, change]))
    assert (t.rows, t.last_seq) == before
    assert t.apply(delta(2, good))  # the same seq, without the bad change, still applies
    assert t.rows["r"] == [[[5, 11], [8]], [[6, 12], [-1]]]


@pytest.mark.parametrize(
    ("change", "exc", "match"),
    [
        ((0, 0, 1.0, 3), TypeError, "four ints"),
        ((0, 0, 1, True), TypeError, "four ints"),
        ((0, 0, 1), TypeError, "four ints"),
        ("0013", TypeError, "four ints"),
    ],
)
def test_malformed_changes_are_refused_before_any_write(change, exc, match):
    t = seeded_tables()
    before = copy.deepcopy((t.rows, t.last_seq))
    with pytest.raises(exc, match=match):
        t.apply(delta(2, [(0, 0, 1, 11), change]))
    assert (t.rows, t.last_seq) == before


def test_a_refused_reset_keeps_the_old_rows():
    t = seeded_tables()
    before = copy.deepcopy((t.rows, t.last_seq))
    with pytest.raises(ValueError, match="unit_id=-7"):
        t.apply(delta(2, [(0, 0, 0, 1), (0, 0, 1, -7)], reset=True))
    assert (t.rows, t.last_seq) == before


def test_shrinking_without_reset_is_refused_before_any_write():
    t = seeded_tables()
    assert t.apply(delta(2, [(0, 0, 1, 11)]))
    before = copy.deepcopy((t.rows, t.last_seq))
    with pytest.raises(ValueError, match=r"leaves group 0 lane 0 holding logical block 1, past num_blocks=1"):
        t.apply(delta(3, [(1, 0, 0, 4)], num_blocks=1))
    assert (t.rows, t.last_seq) == before


def test_delta_fields_are_typed():
    with pytest.raises(ValueError, match=r"num_blocks=-1: expected an int >= 0"):
        KVDelta("r", 1, True, -1, (), LAYOUT.layout_id)
    with pytest.raises(ValueError, match=r"num_blocks=2.5"):
        KVDelta("r", 1, True, 2.5, (), LAYOUT.layout_id)
    with pytest.raises(TypeError, match=r"reset=1: expected a bool"):
        KVDelta("r", 1, 1, 0, (), LAYOUT.layout_id)
    t = LaneTables(LAYOUT)
    with pytest.raises(TypeError, match=r"request_id=7: expected a non-empty str"):
        t.apply(KVDelta(7, 1, True, 0, (), LAYOUT.layout_id))
    assert t.rows == {} and t.last_seq == {}


def test_unit_ids_bounded_by_the_pool_when_known():
    t = LaneTables(LAYOUT, num_units=8)
    with pytest.raises(ValueError, match=r"unit_id=8 is outside \[-1, 8\)"):
        t.apply(delta(1, [(0, 0, 0, 8)], reset=True))
    assert t.apply(delta(1, [(0, 0, 0, 7)], reset=True))


def test_device_tables_refuse_a_too_wide_delta_before_touching_any_row():
    paddle_or_skip()
    from fastdeploy_paddlefleet.serving.model_runner.page_tables import DevicePageTables

    tables = DevicePageTables(LAYOUT, max_num_seqs=2, max_blocks=2)
    assert tables.apply(0, delta(1, [(0, 0, 0, 1), (1, 0, 0, 2), (1, 1, 0, 3)], num_blocks=1, reset=True))
    host = [tables.host_table(g) for g in range(2)]
    lanes = copy.deepcopy((tables.lanes.rows, tables.lanes.last_seq))
    with pytest.raises(ValueError, match=r"holds 3 logical blocks, the page tables have max_blocks=2"):
        tables.apply(0, delta(2, [(0, 0, 1, 4), (0, 0, 2, 5)], num_blocks=3))
    assert all((tables.host_table(g) == host[g]).all() for g in range(2))
    assert all((tables.group_table(g).numpy() == host[g]).all() for g in range(2))
    assert (tables.lanes.rows, tables.lanes.last_seq) == lanes
    with pytest.raises(ValueError, match="unit_id=-7"):
        tables.apply(0, delta(2, [(0, 0, 1, 4), (1, 1, 1, -7)]))
    assert all((tables.host_table(g) == host[g]).all() for g in range(2))


# ---- 6. the computed bound never moves backwards -----------------------------------------------


def mgr_state(mgr):
    return (
        mgr.free_pages,
        {q: (mgr.num_tokens(q), mgr.request_pages(q), mgr.computed(q)) for q in mgr.requests},
        {g: t.tolist() for g, t in mgr.group_tables(mgr.requests).items()},
    )


def test_a_computed_bound_below_the_last_one_is_refused_and_changes_nothing():
    mgr = HeadwiseKVManager(PLAN, num_blocks=16, block_size=2)
    mgr.admit("a")
    assert mgr.reserve("a", 12, 0)
    assert mgr.reserve("a", 14, 10)  # releases head 1's blocks 0..2 (window 3)
    before = mgr_state(mgr)
    msg = r"computed=9 for req_id='a' is below its last computed bound 10"
    for call in (mgr.reserve, mgr.can_reserve):
        with pytest.raises(ValueError, match=msg):
            call("a", 16, 9)
    for call in (mgr.append, mgr.can_append):
        with pytest.raises(ValueError, match=msg):
            call("a", 2, 9)
    with pytest.raises(ValueError, match=msg):
        mgr.release("a", 9)
    assert mgr_state(mgr) == before
    assert mgr.reserve("a", 14, 10) and mgr.release("a", 10) == 0  # the same bound again is fine


def test_preemption_restarts_the_bound():
    mgr = HeadwiseKVManager(PLAN, num_blocks=16, block_size=2)
    mgr.admit("a")
    assert mgr.reserve("a", 12, 10)
    mgr.preempt("a")
    assert mgr.computed("a") == 0
    assert mgr.reserve("a", 4, 0) and mgr.computed("a") == 0  # the recompute starts from zero
    mgr.finish("a")
    mgr.admit("a")
    assert mgr.reserve("a", 2, 0)


# ---- 7. max_context_len (and max_seq_len_this_time) --------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "exc", "match"),
    [
        ("max_context_len", math.nan, TypeError, "meta.max_context_len=nan: expected an int, got float"),
        ("max_context_len", math.inf, TypeError, "meta.max_context_len=inf: expected an int"),
        ("max_context_len", -1, ValueError, r"meta.max_context_len=-1: expected an int in \[0, "),
        ("max_context_len", 7.5, TypeError, "meta.max_context_len=7.5"),
        ("max_context_len", 8.0, TypeError, "meta.max_context_len=8.0"),
        ("max_context_len", True, TypeError, "meta.max_context_len=True"),
        ("max_context_len", 2**31, ValueError, "meta.max_context_len=2147483648"),
        ("max_context_len", 0, ValueError, "meta.max_context_len=0 for a step of 2 tokens"),
        ("max_seq_len_this_time", math.nan, TypeError, "meta.max_seq_len_this_time=nan"),
        ("max_seq_len_this_time", -2, ValueError, "meta.max_seq_len_this_time=-2"),
        ("max_seq_len_this_time", 0, ValueError, "meta.max_seq_len_this_time=0 for a step of 2 tokens"),
    ],
)
def test_batch_meta_maxima_are_checked(name, value, exc, match):
    np = pytest.importorskip("numpy")
    args = dict(
        seq_lens_encoder=[2],
        seq_lens_decoder=[0],
        seq_lens_this_time=[2],
        cu_seqlens_q=[0, 2],
        batch_id_per_token=np.zeros([2], "int32"),
        block_tables=[[0]],
        block_size=4,
    )
    with pytest.raises(exc, match=match):
        BatchMeta(**args, **{name: value})
    ok = BatchMeta(**args, max_seq_len_this_time=np.int64(2), max_context_len=np.int32(2))
    assert (ok.max_seq_len_this_time, ok.max_context_len) == (2, 2) and type(ok.max_context_len) is int
    empty = dict(args, batch_id_per_token=np.zeros([0], "int32"))
    assert BatchMeta(**empty, max_seq_len_this_time=0, max_context_len=0).max_context_len == 0  # no tokens


def test_max_context_len_below_max_seq_len_this_time_is_refused():
    np = pytest.importorskip("numpy")
    with pytest.raises(ValueError, match="meta.max_context_len=3 is below meta.max_seq_len_this_time=5"):
        BatchMeta([5], [0], [5], [0, 5], np.zeros([5], "int32"), [[0, 1]], 4, None, 5, 3)


# ---- 8. lookahead_tokens -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "exc", "match"),
    [
        (-1, ValueError, "lookahead_tokens=-1"),
        (2.5, TypeError, "lookahead_tokens=2.5"),
        (3.0, TypeError, "lookahead_tokens=3.0"),
        (True, TypeError, "lookahead_tokens=True"),
        (math.nan, TypeError, "lookahead_tokens=nan"),
        (2**31, ValueError, "lookahead_tokens=2147483648"),
        (10**30, ValueError, "lookahead_tokens="),
    ],
)
def test_lookahead_tokens_are_checked(value, exc, match):
    groups = groups_from_plan(PLAN, "headwise")
    with pytest.raises(exc, match=match):
        pool_demand(groups, 4, 64, 0, value)
    with pytest.raises(exc, match=match):
        size_pools(groups, 2**20, {g.index: 1024 for g in groups}, 4, 64, 0, value)
    per_req, _ = pool_demand(groups, 4, 64, 0, 12)
    # independent: a full lane holds ceil((64 + 12) / 4) = 19 blocks; the head-wise group's full
    # lane 19 / 2 and its sliding lane (window 3) min(19, ceil((3 + 12) / 4) + 2) / 2 = 3
    assert per_req == [19.0, 19 / 2 + 6 / 2]


@pytest.mark.parametrize(
    ("value", "match"), [(4.7, "block_size=4.7"), (True, "block_size=True"), (0, "block_size=0")]
)
def test_fastdeploy_lookahead_refuses_a_bad_block_size(value, match):
    with pytest.raises(ValueError, match=match):
        fastdeploy_lookahead(value)
    assert fastdeploy_lookahead(64) == 2 * 64 + 12
