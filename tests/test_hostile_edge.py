"""Hostile metadata at the FastDeploy edge (issue 19, bullet 2) and in served mode.

Three layers are held to it:

* ``serving/forward_meta.py`` (ForwardMeta -> BatchMeta, sync-free): a float or bool field is refused
  naming it (``.astype("int32")`` truncated 2.7 to 2), an int64 value beyond int32 is refused where the
  host holds it (it wrapped: 2**32 became page 0) and an int64 device tensor is refused by dtype, a
  cache tensor used twice (K is V, or shared by two layers) is refused;
* ``backends/checks.py``: checked mode (``validate_inputs``, what the reference backend and
  ``host_checks=True`` run) refuses the same plus aliasing (two logical blocks of one request on one
  block, a block written by one request and used by another); served mode (``validate_shapes``,
  ``host_checks=False``) keeps to O(1) checks: dtypes, K is V, zero strides;
* served mode end to end: ``PaddleFleetForCausalLM`` with the triton backend under
  ``TRITON_INTERPRET=1`` runs a step with a bad table without touching memory outside its caches,
  and the NEXT step's ``compute_logits`` raises the kernels' named error; a seeded generator of 240
  bad steps through the served path gives, for every case, either a named error at the edge or the
  kernel flag naming the corrupted entry.

References are independent of the code under test: the expected field, entry and value come from
the corruption each case injects.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from types import SimpleNamespace

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

from fastdeploy_paddlefleet.backends import get_backend  # noqa: E402
from fastdeploy_paddlefleet.backends.checks import (  # noqa: E402
    check_int32_narrowing,
    validate_inputs,
    validate_shapes,
)
from fastdeploy_paddlefleet.plan.layer import LayerAttention  # noqa: E402
from fastdeploy_paddlefleet.runner.batch import build_meta  # noqa: E402
from fastdeploy_paddlefleet.serving.forward_meta import (  # noqa: E402
    batch_meta_from_forward_meta,
    pair_caches,
)

HKV, GROUP, D, BS, NB = 2, 2, 8, 4, 8
INT_FIELDS = (
    "seq_lens_encoder",
    "seq_lens_decoder",
    "seq_lens_this_time",
    "cu_seqlens_q",
    "batch_id_per_token",
)


def layer_(**kw) -> LayerAttention:
    base = dict(index=0, kind="full", num_q_heads=HKV * GROUP, num_kv_heads=HKV, qk_head_dim=D, v_head_dim=D)
    base.update(softmax_scale=0.5, **kw)
    return LayerAttention(**base)


def forward_meta(dec=(5, 0), this=(2, 3), tables=((2, 0), (1,)), **over) -> SimpleNamespace:
    """A FastDeploy-shaped ForwardMeta on the host (numpy int32), fields overridable."""
    this_a = np.asarray(this, "int32")
    width = max(len(t) for t in tables)
    table = np.full([len(tables), width], -1, "int32")
    for r, row in enumerate(tables):
        table[r, : len(row)] = row
    fields = dict(
        seq_lens_encoder=np.where(np.asarray(dec) == 0, this_a, 0).astype("int32")[:, None],
        seq_lens_decoder=np.asarray(dec, "int32")[:, None],
        seq_lens_this_time=this_a,
        cu_seqlens_q=np.concatenate([[0], np.cumsum(this_a)]).astype("int32"),
        batch_id_per_token=np.repeat(np.arange(len(this_a)), this_a).astype("int32"),
        block_tables=table,
        exist_prefill=True,
    )
    fields.update(over)
    return SimpleNamespace(**fields)


def step(dec=(5, 0), this=(2, 4), tables=((2, 0), (1,)), layer=None, **meta_kw) -> dict:
    t = sum(this)
    return dict(
        q=paddle.zeros([t, HKV * GROUP, D]),
        k=paddle.zeros([t, HKV, D]),
        v=paddle.zeros([t, HKV, D]),
        layer=layer or layer_(),
        meta=build_meta(list(dec), list(this), [list(x) for x in tables], BS, **meta_kw),
        kv_cache=(paddle.zeros([NB, HKV, BS, D]), paddle.zeros([NB, HKV, BS, D])),
    )


CHECKS = {"checked": validate_inputs, "served": validate_shapes}


# ---- ForwardMeta -> BatchMeta -------------------------------------------------------------------


@pytest.mark.parametrize("field", INT_FIELDS + ("block_tables",))
def test_edge_refuses_a_float_field_naming_it(field):
    """A float field was cast with ``.astype("int32")``: 2.7 became 2, silently."""
    fm = forward_meta()
    setattr(fm, field, np.asarray(getattr(fm, field), "float32") + 0.7)
    with pytest.raises(TypeError, match=rf"forward_meta\.{field} must hold integers .*float32"):
        batch_meta_from_forward_meta(fm, BS)


def test_edge_refuses_a_float_paddle_table_and_a_bool_length():
    fm = forward_meta(block_tables=paddle.to_tensor([[2.7, 0.0], [1.0, -1.0]]))
    with pytest.raises(TypeError, match=r"forward_meta\.block_tables must hold integers"):
        batch_meta_from_forward_meta(fm, BS)
    fm = forward_meta(seq_lens_this_time=np.array([True, True]))
    with pytest.raises(TypeError, match=r"forward_meta\.seq_lens_this_time must hold integers .*bool"):
        batch_meta_from_forward_meta(fm, BS)


def test_edge_refuses_a_float_headwise_table_in_a_mapping():
    fm = forward_meta(block_tables_headwise={0: np.zeros([4, 2], "float64")})
    with pytest.raises(TypeError, match=r"forward_meta\.block_tables_headwise\[0\] must hold integers"):
        batch_meta_from_forward_meta(fm, BS)


@pytest.mark.parametrize("as_paddle", [False, True], ids=["numpy", "paddle-cpu"])
def test_edge_refuses_a_page_id_2_pow_32_instead_of_wrapping_it_to_0(as_paddle):
    table = np.array([[2, 2**32], [1, -1]], "int64")
    assert table.astype("int32")[0, 1] == 0  # what the old cast made of it: a valid page
    fm = forward_meta(block_tables=paddle.to_tensor(table) if as_paddle else table)
    with pytest.raises(ValueError, match=r"forward_meta\.block_tables\[0, 1\] = 4294967296 is outside int32"):
        batch_meta_from_forward_meta(fm, BS)


def test_edge_refuses_lengths_beyond_int32_and_keeps_int64_in_range():
    fm = forward_meta(seq_lens_decoder=np.array([[2**31], [0]], "int64"))
    with pytest.raises(ValueError, match=r"forward_meta\.seq_lens_decoder\[0, 0\] = 2147483648"):
        batch_meta_from_forward_meta(fm, BS)
    fm = forward_meta(block_tables=np.array([[2, 0], [1, -1]], "int64"), cu_seqlens_q=[0, 2, 5])
    meta = batch_meta_from_forward_meta(fm, BS)
    assert meta.block_tables.dtype == paddle.int32 and meta.cu_seqlens_q.dtype == paddle.int32
    np.testing.assert_array_equal(meta.block_tables.numpy(), [[2, 0], [1, -1]])
    np.testing.assert_array_equal(meta.cu_seqlens_q.numpy(), [0, 2, 5])


def test_int64_on_a_device_is_refused_by_dtype_without_reading_it():
    """Served mode cannot range-check device values without a sync: int64 there is refused (a torch
    ``meta`` tensor stands in for a device tensor: it has no values to read at all)."""
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"forward_meta\.block_tables is int64 on meta.*pass int32"):
        check_int32_narrowing(
            "forward_meta.block_tables", torch.empty(2, 3, dtype=torch.int64, device="meta")
        )
    check_int32_narrowing("x", torch.empty(2, dtype=torch.int32, device="meta"))  # int32 passes unread


def test_edge_refuses_one_tensor_as_k_and_v_and_a_tensor_shared_by_layers():
    a, b, c = (paddle.zeros([NB, HKV, BS, D]) for _ in range(3))
    with pytest.raises(ValueError, match="layer 0 value cache is the same tensor as the layer 0 key cache"):
        pair_caches([a, a], 1)
    with pytest.raises(ValueError, match="layer 1 key cache is the same tensor as the layer 0 value cache"):
        pair_caches([a, b, b, c], 2)
    assert len(pair_caches([a, b, c, paddle.zeros([1])], 2)) == 2


# ---- the backend API: checked and served mode ---------------------------------------------------


@pytest.mark.parametrize("mode", CHECKS)
@pytest.mark.parametrize("field", INT_FIELDS + ("block_tables",))
def test_backend_refuses_float_metadata_in_both_modes(mode, field):
    a = step()
    a["meta"] = dataclasses.replace(a["meta"], **{field: getattr(a["meta"], field).astype("float32")})
    with pytest.raises(TypeError, match=rf"meta\.{field} must hold integers"):
        CHECKS[mode](**a)


def test_served_mode_refuses_a_float_headwise_table():
    a = step()
    a["meta"] = dataclasses.replace(a["meta"], block_tables_headwise={0: paddle.zeros([4, 2])})
    with pytest.raises(TypeError, match=r"meta\.block_tables_headwise must hold integers"):
        validate_shapes(**a)


def test_checked_mode_refuses_int64_beyond_int32_naming_the_entry():
    a = step()
    table = np.array([[2, 0], [2**32 + 1, -1]], "int64")
    a["meta"] = dataclasses.replace(a["meta"], block_tables=paddle.to_tensor(table))
    with pytest.raises(ValueError, match=r"meta\.block_tables\[1, 0\] = 4294967297 is outside int32"):
        validate_inputs(**a)
    with pytest.raises(ValueError, match=r"meta\.block_tables\[1, 0\] = 4294967297 is outside int32"):
        validate_shapes(**a)  # a CPU tensor: the host has the values, the served check reads them too


def test_two_logical_blocks_of_one_request_on_one_block():
    """Request 0 (5 cached + 2) reads logical blocks 0 and 1, both mapped to physical block 2: the new
    keys (positions 5, 6) would overwrite positions 1, 2 that the same step still reads."""
    with pytest.raises(
        ValueError, match="block 2 appears twice in row 0 .*logical blocks 0 and 1 on one block"
    ):
        get_backend("reference").forward(**step(tables=((2, 2), (1,))))


def test_two_requests_writing_one_block_in_different_slots():
    """Request 0 writes slots 0-1 of block 3, request 1 (6 cached) writes slot 2 of block 3: no slot
    collides, but each request's block 3 holds the other's keys."""
    a = step(dec=(0, 6), this=(2, 1), tables=((3,), (1, 3)))
    with pytest.raises(
        ValueError, match="block 3 is written this step by request 0 and also written by request 1"
    ):
        get_backend("reference").forward(**a)  # it accepted this and returned wrong outputs


def test_a_block_written_by_one_request_and_read_by_another():
    a = step(dec=(0, 5), this=(2, 1), tables=((3,), (3, 4)))
    with pytest.raises(ValueError, match="block 3 is written this step by request 0 and read by request 1"):
        validate_inputs(**a)


def test_headwise_page_twice_in_one_row_names_the_logical_blocks():
    layer = layer_(kind="headwise", window_left=2, sliding_kv_heads=(1, 2))
    pages = np.array([[9, 9], [2, 3], [8, 7], [6, 4]], "int32")
    a = step(dec=(4, 4), this=(1, 1), tables=((0, 0), (0, 0)), layer=layer, block_tables_headwise=pages)
    with pytest.raises(
        ValueError, match=r"page 9 appears twice in row 0 \(request 0 kv head 0.*logical blocks 0"
    ):
        validate_inputs(**a)


@pytest.mark.parametrize("mode", CHECKS)
def test_k_cache_is_v_cache(mode):
    a = step()
    a["kv_cache"] = (a["kv_cache"][0], a["kv_cache"][0])
    with pytest.raises(ValueError, match="K and V caches must be distinct tensors"):
        CHECKS[mode](**a)


def test_k_cache_is_v_cache_through_the_reference_backend():
    a = step()
    a["kv_cache"] = (a["kv_cache"][1], a["kv_cache"][1])
    with pytest.raises(ValueError, match="K and V caches must be distinct tensors"):
        get_backend("reference").forward(**a)


@pytest.mark.parametrize("mode", CHECKS)
@pytest.mark.parametrize(("axis", "what"), [(0, "blocks"), (1, "kv heads"), (2, "slots")])
def test_zero_stride_on_a_cached_axis(mode, axis, what):
    a = step()
    base = paddle.zeros([NB, HKV, BS, D])
    strides = [HKV * BS * D, BS * D, D, 1]
    strides[axis] = 0
    a["kv_cache"] = (paddle.as_strided(base, [NB, HKV, BS, D], strides), a["kv_cache"][1])
    with pytest.raises(ValueError, match=rf"key cache\) has stride 0 on axis {axis} \({what}"):
        CHECKS[mode](**a)


def test_zero_stride_torch_broadcast_view_through_the_reference_backend():
    torch = pytest.importorskip("torch")
    a = step()
    key = torch.zeros(NB, 1, BS, D).expand(NB, HKV, BS, D)  # both kv heads share one row
    a.update(q=torch.zeros(6, HKV * GROUP, D), k=torch.zeros(6, HKV, D), v=torch.zeros(6, HKV, D))
    a["kv_cache"] = (key, torch.zeros(NB, HKV, BS, D))
    with pytest.raises(ValueError, match=r"stride 0 on axis 1 \(kv heads"):
        get_backend("reference").forward(**a)


def test_valid_steps_still_pass_both_modes():
    for mode in CHECKS.values():
        mode(**step())
        mode(**step(dec=(4, 4), this=(1, 1), tables=((0, 1), (0, 2))))  # a shared read-only prefix block


# ---- served mode end to end: the model class, the triton backend, the kernels' flag -------------

triton_needed = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None,
    reason="needs triton and torch (the kernels under TRITON_INTERPRET=1 on CPU)",
)


def _served_model():
    from fastdeploy_paddlefleet.backends.triton import TritonBackend
    from fastdeploy_paddlefleet.minifleet import build_minifleet
    from fastdeploy_paddlefleet.plan import plan_from_config
    from fastdeploy_paddlefleet.serving.model import PaddleFleetForCausalLM

    model = build_minifleet("tiny", seed=3)
    backend = TritonBackend(host_checks=False)  # what PaddleFleetForCausalLM(fd_config) sets under FastDeploy
    return PaddleFleetForCausalLM.from_model(model, plan_from_config(model.config), backend=backend)


def _caches(wrapper, num_blocks=NB):
    from fastdeploy_paddlefleet.patch import cache_plan

    caches = []
    for layer in cache_plan(wrapper.plan, wrapper.backend):
        shape = [num_blocks, layer.num_kv_heads, BS]
        caches += [paddle.zeros(shape + [layer.qk_head_dim]), paddle.zeros(shape + [layer.v_head_dim])]
    return caches


def _run(wrapper, fm, caches):
    fm.caches = caches
    tokens = int(np.asarray(fm.cu_seqlens_q)[-1])
    ids = {"ids_remove_padding": paddle.to_tensor(np.arange(tokens, dtype="int64") % 50 + 1)}
    return wrapper.compute_logits(wrapper(ids, fm), fm)


@triton_needed
def test_model_reports_a_bad_table_at_the_next_compute_logits():
    """A page id past the cache (5000 of 8 blocks) in request 1's visible range: the step runs (no
    read outside the cache), its own compute_logits does not sync on the flag, and the next step's
    compute_logits raises the kernels' error naming request 1, logical block 1 and the value."""
    wrapper = _served_model()
    caches = _caches(wrapper)
    _run(wrapper, forward_meta(dec=(0, 0), this=(3, 2), tables=((0,), (1,))), caches)  # clean prefills
    bad = forward_meta(dec=(3, 2), this=(1, 3), tables=((0,), (1, 5000)))
    logits = _run(wrapper, bad, caches)  # the bad step itself: memory-safe, reported one step late
    assert list(logits.shape) == [4, 256]
    with pytest.raises(
        ValueError, match=r"request 1, logical block 1: entry 5000 is past the cache \(8 blocks\)"
    ):
        _run(wrapper, forward_meta(dec=(4, 5), this=(1, 1), tables=((0, 2), (1, 3))), caches)
    # reported once and cleared: serving goes on with valid tables
    _run(wrapper, forward_meta(dec=(5, 6), this=(1, 1), tables=((0, 2), (1, 3))), caches)
    _run(wrapper, forward_meta(dec=(6, 7), this=(1, 1), tables=((0, 2), (1, 3))), caches)


@triton_needed
def test_deferred_check_reads_a_paddle_flag_one_step_late_and_reports_once():
    """The torch-free deployment's flag is a paddle tensor: the same one-step-late read. The flag's
    values are written here by hand (``kernels/errors.py`` layout), so the expected message comes from
    them, not from the code under test."""
    from fastdeploy_paddlefleet.backends.deferred_errors import DeferredErrorCheck
    from fastdeploy_paddlefleet.backends.triton import TritonBackend

    backend = TritonBackend(host_checks=False)
    flag = backend.error_flag(paddle.zeros([1]))  # what a launch on paddle tensors without torch uses
    assert isinstance(flag, paddle.Tensor)
    check = DeferredErrorCheck(backend)
    check.snapshot()  # step 1 clean
    flag[:] = paddle.to_tensor([1, 2, 3, 999, -1, 3, 8, 0], dtype="int32")  # step 2's kernels record
    check.snapshot()
    check.check()  # step 2's compute_logits: only step 1's copy is known to have landed
    check.snapshot()  # step 3
    with pytest.raises(ValueError, match=r"decode attention kernel: request 2, logical block 3: entry 999"):
        check.check()
    assert flag.tolist() == [0] * 8  # cleared: serving goes on
    for _ in range(3):
        check.snapshot()
        check.check()  # reported once


# ---- a seeded generator of hostile metadata through the served path ------------------------------

CORRUPTIONS = (
    "float_field",
    "bool_field",
    "int64_beyond_int32",
    "int64_in_range",
    "past_cache",
    "negative_visible",
    "narrow_table",
    "k_is_v",
    "short_cu_seqlens",
    "headwise_page_past_cache",
)


def _valid_case(rng):
    """A valid step of 1-3 requests on NB blocks: ``(dec, this, table)``."""
    bsz = int(rng.integers(1, 4))
    free = list(rng.permutation(NB))
    dec, this, rows = [], [], []
    for _ in range(bsz):
        n = int(rng.integers(1, 4))
        d = int(rng.integers(0, 2 * BS))
        need = (d + n - 1) // BS + 1
        if need > len(free):
            d, n, need = 0, 1, 1
        dec.append(d)
        this.append(n)
        rows.append([int(free.pop()) for _ in range(need)])
    width = max(len(r) for r in rows) + int(rng.integers(0, 2))
    table = np.full([bsz, width], -1, "int32")
    for r, row in enumerate(rows):
        table[r, : len(row)] = row
    return dec, this, table


def _pages(table):
    """The head-wise page table ``[bsz * HKV, width]`` of a block table: page ``block * HKV + head``."""
    pages = table[:, None, :] * HKV + np.arange(HKV)[None, :, None]
    return np.where(table[:, None, :] >= 0, pages, -1).reshape(-1, table.shape[1]).astype("int32")


def _hostile_case(seed: int):
    """One corrupted served step: ``(forward_meta, kv_cache, layer, expectation)``; expectation is
    ``("edge", exception type, regex)``, ``("flag", request, logical block, value, kv head)`` (``None``:
    not fixed by the case) or ``("clean",)``."""
    rng = np.random.default_rng(seed)
    dec, this, table = _valid_case(rng)
    kind = CORRUPTIONS[seed % len(CORRUPTIONS)]
    fm = forward_meta(dec=dec, this=this, tables=[[0]] * len(dec))
    fm.block_tables = table
    kv = (paddle.zeros([NB, HKV, BS, D]), paddle.zeros([NB, HKV, BS, D]))
    b = int(rng.integers(0, len(dec)))
    visible = (dec[b] + this[b] - 1) // BS  # request b's last logical block (a full layer sees 0..it)
    col = int(rng.integers(0, visible + 1))
    layer = layer_()
    if kind == "headwise_page_past_cache":  # kv head 0 is a full head: every visible page is read
        layer = layer_(kind="headwise", window_left=2, sliding_kv_heads=(1, 2))
        pages = _pages(table)
        value = int(rng.choice([NB * HKV, NB * HKV + 7, 2**30]))
        pages[b * HKV, col] = value
        fm.block_tables_headwise = pages
        return fm, kv, layer, ("flag", b, col, value, 0)
    if kind in ("float_field", "bool_field"):
        field = str(rng.choice(INT_FIELDS + ("block_tables",)))
        value = np.asarray(getattr(fm, field))
        setattr(fm, field, value.astype("float64") + 0.5 if kind == "float_field" else value != 0)
        return fm, kv, layer, ("edge", TypeError, rf"forward_meta\.{field} must hold integers")
    if kind == "int64_beyond_int32":
        wide = table.astype("int64")
        wide[b, col] = int(rng.choice([2**32, 2**31, -(2**31) - 1, 2**40 + 3]))
        fm.block_tables = wide
        match = rf"block_tables\[{b}, {col}\] = {wide[b, col]} is outside int32"
        return fm, kv, layer, ("edge", ValueError, match)
    if kind == "int64_in_range":
        fm.block_tables = table.astype("int64")
        fm.seq_lens_decoder = np.asarray(fm.seq_lens_decoder, "int64")
        return fm, kv, layer, ("clean",)
    if kind == "past_cache":
        value = int(rng.choice([NB, NB + 1, 2**20, 2**31 - 1]))
        table[b, col] = value
        return fm, kv, layer, ("flag", b, col, value, None)
    if kind == "negative_visible":
        value = int(rng.choice([-1, -2, -(2**31)]))
        table[b, col] = value
        return fm, kv, layer, ("flag", b, col, value, None)
    if kind == "narrow_table":
        if visible == 0:  # one block: a zero-width table is too narrow for any request
            fm.block_tables = table[:, :0]
            return fm, kv, layer, ("flag", None, None, None, None)
        fm.block_tables = np.ascontiguousarray(table[:, :visible])  # drop the last visible column
        return fm, kv, layer, ("flag", None, None, None, None)
    if kind == "k_is_v":
        return fm, (kv[0], kv[0]), layer, ("edge", ValueError, "K and V caches must be distinct tensors")
    assert kind == "short_cu_seqlens"
    fm.cu_seqlens_q = np.asarray(fm.cu_seqlens_q)[:-1]
    return fm, kv, layer, ("edge", ValueError, r"cu_seqlens_q must have bsz \+ 1")


FLAG = re.compile(
    r"request (\d+)(?: kv head (\d+))?, logical block (-?\d+): (?:entry (-?\d+)|the table has only)"
)


@triton_needed
def test_seeded_hostile_metadata_through_the_served_path():
    """250 seeded cases (every corruption kind many times) through ForwardMeta -> BatchMeta -> the triton
    backend in served mode (``host_checks=False``: shape/dtype checks only, the kernels bounds-check)
    -> the error flag. Each case: a named edge error, or the flag naming the corrupted entry, or (valid
    int64 input) a clean flag. Never a crash, never an unnamed error."""
    from fastdeploy_paddlefleet.backends.triton import TritonBackend

    backend = TritonBackend(host_checks=False)
    seen = dict.fromkeys(CORRUPTIONS, 0)
    for seed in range(250):
        fm, kv, layer, expect = _hostile_case(seed)
        seen[CORRUPTIONS[seed % len(CORRUPTIONS)]] += 1
        if expect[0] == "edge":
            with pytest.raises(expect[1], match=expect[2]):
                meta = batch_meta_from_forward_meta(fm, BS, int(np.asarray(fm.cu_seqlens_q)[-1]))
                t = int(np.asarray(fm.cu_seqlens_q)[-1])
                backend.forward(
                    paddle.randn([t, HKV * GROUP, D]), paddle.randn([t, HKV, D]), paddle.randn([t, HKV, D]),
                    layer, meta, kv,
                )  # fmt: skip
            continue
        t = int(np.asarray(fm.cu_seqlens_q)[-1])
        meta = batch_meta_from_forward_meta(fm, BS, t)
        q, k, v = paddle.randn([t, HKV * GROUP, D]), paddle.randn([t, HKV, D]), paddle.randn([t, HKV, D])
        out = backend.forward(q, k, v, layer, meta, kv)
        assert list(out.shape) == [t, HKV * GROUP * D], seed
        if expect[0] == "clean":
            backend.check_errors()
            continue
        with pytest.raises(ValueError, match="bad (block|page) table entry") as info:
            backend.check_errors()
        m = FLAG.search(str(info.value))
        assert m, (seed, str(info.value))
        req, head, blk, value = (None if g is None else int(g) for g in m.groups())
        got = (req, blk, value, head)
        for want, have in zip(expect[1:], got, strict=True):  # request, logical block, value, kv head
            assert want is None or want == have, (seed, str(info.value))
        backend.check_errors()  # cleared after reporting
    assert min(seen.values()) >= 20, seen
