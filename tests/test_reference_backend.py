"""ReferenceBackend against a dense numpy reference (tests/_dense_attention.py).

Cases run the way FastDeploy's worker does: several steps, each writing its
K/V into the paged cache before attending; the dense reference sees the
concatenation of every step's K/V of the request. The cache starts as NaN and
pages a sliding head no longer needs are set to NaN and marked -1, so any read
of an unwritten or released slot shows up as NaN in the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest
from _dense_attention import dense_attention
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

paddle = pytest.importorskip("paddle")

from fastdeploy_paddlefleet.backends import get_backend  # noqa: E402
from fastdeploy_paddlefleet.plan.layer import LayerAttention  # noqa: E402
from fastdeploy_paddlefleet.runner.batch import PagedKVState, allocate_kv_caches  # noqa: E402

TOL = 1e-5
#: relative error of the final rounding to each output dtype (inputs are rounded before the dense reference)
RTOL = {"float32": 0.0, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def make_layer(
    hkv: int,
    group: int,
    dqk: int,
    dv: int,
    *,
    kind: str = "full",
    window: int | None = None,
    sliding: int | None = None,
    sink: str = "vanilla",
    index: int = 0,
) -> LayerAttention:
    """``sliding``: number of (last) kv heads that slide, for head-wise layers."""
    ranges = {"full": None, "sliding": (0, hkv), "headwise": (hkv - (sliding or 0), hkv)}
    return LayerAttention(
        index=index,
        kind=kind,
        num_q_heads=hkv * group,
        num_kv_heads=hkv,
        qk_head_dim=dqk,
        v_head_dim=dv,
        softmax_scale=1.0 / math.sqrt(dqk),
        window_left=None if kind == "full" else window,
        sliding_kv_heads=ranges[kind],
        sink=sink,
    )


@dataclass
class Case:
    layer: LayerAttention
    block_size: int
    steps: list[list[tuple[int, int]]]  # per step: (request id, new tokens)
    page_table: bool = False  # drive the layer with a head-wise page table
    release: bool = False  # mark pages out of every future window -1 and NaN them
    table_as_mapping: bool = False
    shuffle_seed: int | None = 0
    seed: int = 0
    sink_scale: float = 2.0
    sink_value: float | None = None  # every learnable sink set to this logit
    torch_inputs: bool = False
    dtype: str = "float32"  # q/k/v and cache dtype


@dataclass
class _Driver:
    """Runs a Case step by step; keeps each request's K/V history and page layout."""

    case: Case
    rng: np.random.Generator = field(init=False)
    errors: list[float] = field(default_factory=list)
    num_released: int = 0

    def __post_init__(self):
        self.rng = np.random.default_rng(self.case.seed)

    def run(self) -> float:
        c, layer = self.case, self.case.layer
        hkv, bs = layer.num_kv_heads, c.block_size
        totals: dict[int, int] = {}
        for step in c.steps:
            for rid, n in step:
                totals[rid] = totals.get(rid, 0) + n
        max_blocks = max(-(-t // bs) for t in totals.values()) + 1
        num_blocks = sum(-(-t // bs) for t in totals.values()) + 3
        state = PagedKVState(num_blocks, bs, max_blocks, shuffle_seed=c.shuffle_seed)
        kc, vc = allocate_kv_caches([layer], num_blocks, bs, c.dtype, fill=float("nan"))[0]
        sinks = None
        if layer.sink == "learnable":
            sinks = (self.rng.standard_normal(layer.num_q_heads) * c.sink_scale).astype("float32")
            if c.sink_value is not None:
                sinks[:] = c.sink_value
        ref_sinks = {"vanilla": None, "off-by-one": np.zeros(layer.num_q_heads), "learnable": sinks}[
            layer.sink
        ]
        hist: dict[int, tuple[list, list]] = {}
        perms: dict[tuple[int, int], np.ndarray] = {}  # (request, logical block) -> kv head -> page slot
        released: dict[int, set[tuple[int, int]]] = {}  # request -> {(kv head, logical block)}
        backend = get_backend("reference")
        windows = [layer.head_window(h) for h in range(hkv)]
        for step in c.steps:
            meta = state.schedule(step)
            t = int(meta.cu_seqlens_q[-1])
            q = self.rng.standard_normal((t, layer.num_q_heads, layer.qk_head_dim)).astype("float32")
            k = self.rng.standard_normal((t, hkv, layer.qk_head_dim)).astype("float32")
            v = self.rng.standard_normal((t, hkv, layer.v_head_dim)).astype("float32")
            q, k, v = (self._round(x) for x in (q, k, v))
            blocks = meta.block_tables.numpy().copy()
            if c.page_table:
                pages = np.full((len(step) * hkv, blocks.shape[1]), -1, dtype="int32")
                for b, (rid, _) in enumerate(step):
                    for lb in np.nonzero(blocks[b] >= 0)[0]:
                        perm = perms.setdefault((rid, int(lb)), self.rng.permutation(hkv))
                        for h in range(hkv):
                            if (h, int(lb)) not in released.get(rid, ()):
                                pages[b * hkv + h, lb] = blocks[b, lb] * hkv + perm[h]
                table = paddle.to_tensor(pages)
                meta.block_tables_headwise = {layer.index: table} if c.table_as_mapping else table
            else:
                for b, (rid, _) in enumerate(step):
                    for _, lb in released.get(rid, ()):
                        blocks[b, lb] = -1
                meta.block_tables = paddle.to_tensor(blocks)
            out = self._forward(backend, q, k, v, meta, (kc, vc), sinks)
            assert out.shape == [t, layer.num_q_heads * layer.v_head_dim]
            starts = meta.cu_seqlens_q.numpy()
            for b, (rid, n) in enumerate(step):
                ks, vs = hist.setdefault(rid, ([], []))
                s = int(starts[b])
                ks.append(k[s : s + n])
                vs.append(v[s : s + n])
                if n == 0:
                    continue
                dec = int(meta.seq_lens_decoder[b])
                want = dense_attention(
                    q[s : s + n],
                    np.concatenate(ks),
                    np.concatenate(vs),
                    dec,
                    scale=layer.softmax_scale,
                    windows=windows,
                    sinks=ref_sinks,
                )
                got = out[s : s + n].numpy()
                assert np.isfinite(got).all(), f"NaN/inf in output of request {rid} (read a released slot?)"
                # error beyond the output dtype's rounding (plain max abs error for fp32)
                self.errors.append(float((np.abs(got - want) - RTOL[c.dtype] * np.abs(want)).max()))
            if c.release:
                self._release(step, state, blocks, perms, released, kc, vc, windows)
        return max(self.errors, default=0.0)

    def _round(self, x: np.ndarray) -> np.ndarray:
        """``x`` rounded to the case's dtype (kept as fp32 numpy for the dense reference)."""
        if self.case.dtype == "float32":
            return x
        return paddle.to_tensor(x).astype(self.case.dtype).astype("float32").numpy()

    def _forward(self, backend, q, k, v, meta, kv_cache, sinks):
        layer = self.case.layer
        if not self.case.torch_inputs:
            args = [paddle.to_tensor(x).astype(self.case.dtype) for x in (q, k, v)]
            s = None if sinks is None else paddle.to_tensor(sinks)
            out = backend.forward(*args, layer, meta, kv_cache, s)
            assert out.dtype == args[0].dtype
            return out.astype("float32")
        import torch

        tk, tv = (torch.from_dlpack(x) for x in kv_cache)  # shares memory with the paddle caches
        out = backend.forward(*(torch.from_numpy(x) for x in (q, k, v)), layer, meta, (tk, tv), sinks)
        assert isinstance(out, torch.Tensor)
        return paddle.to_tensor(out.numpy())

    def _release(self, step, state, blocks, perms, released, kc, vc, windows):
        """Release the pages no current or future query of a request can see; fill them with NaN."""
        c, bs = self.case, self.case.block_size
        if not c.page_table and any(w is None for w in windows):
            return  # full heads share the block table: no block can go
        for rid, _ in step:
            cached = state.cached_tokens(rid)  # the next query's position
            for h, w in enumerate(windows):
                for lb in range(0 if w is None else max(0, cached - w) // bs):
                    if (h, lb) in released.setdefault(rid, set()):
                        continue
                    released[rid].add((h, lb))
                    self.num_released += 1
                    block = state.block_table(rid)[lb]
                    slot = int(perms[(rid, lb)][h]) if c.page_table else h
                    kc[block, slot] = float("nan")
                    vc[block, slot] = float("nan")


def run_case(case: Case) -> float:
    return _Driver(case).run()


# ---------------------------------------------------------------- randomized


@st.composite
def cases(draw, long_decode: bool = False) -> Case:
    """Random layer + multi-step schedule. ``long_decode``: a sliding / head-wise layer with
    small blocks and windows decoding well past its window, on a page table that releases."""
    group = draw(st.sampled_from([1, 4, 8]))
    kind = draw(st.sampled_from(["sliding", "headwise"] if long_decode else ["full", "sliding", "headwise"]))
    hkv = draw(st.sampled_from([2, 4] if kind == "headwise" else [1, 2]))
    dqk = draw(st.sampled_from([16, 32, 64, 96, 128, 192]))
    dv = dqk if dqk <= 128 and draw(st.booleans()) else draw(st.sampled_from([16, 32, 64, 128]))
    windows = [0, 1, 3, 7] if long_decode else [0, 1, 2, 3, 5, 9, 200]
    window = draw(st.sampled_from(windows)) if kind != "full" else None
    ratio = draw(st.sampled_from([0.25, 0.5, 0.75]))
    layer = make_layer(
        hkv,
        group,
        dqk,
        dv,
        kind=kind,
        window=window,
        sliding=int(ratio * hkv),
        sink=draw(st.sampled_from(["vanilla", "off-by-one", "learnable"])),
    )
    block_size = draw(st.sampled_from([1, 2, 4, 16] if long_decode else [1, 16, 64]))
    bsz = draw(st.integers(1, 4 if long_decode else 8))
    # per request: a list of chunks; the first may be a long prefill, then chunks or decode tokens
    if long_decode:
        plans = [[draw(st.integers(1, 20))] + [1] * draw(st.integers(8, 24)) for _ in range(bsz)]
    else:
        plans = [
            draw(st.lists(st.one_of(st.just(1), st.integers(1, 24)), min_size=1, max_size=6))
            for _ in range(bsz)
        ]
    offsets = [draw(st.integers(0, 2)) for _ in range(bsz)]  # requests join at different steps
    steps: list[list[tuple[int, int]]] = []
    for s in range(max(o + len(p) for o, p in zip(offsets, plans, strict=True))):
        step = [
            (r, p[s - o]) for r, (o, p) in enumerate(zip(offsets, plans, strict=True)) if 0 <= s - o < len(p)
        ]
        if step:
            draw(st.randoms(use_true_random=False)).shuffle(step)  # batch order != admission order
            steps.append(step)
    return Case(
        layer=layer,
        block_size=block_size,
        steps=steps,
        page_table=long_decode or draw(st.booleans()),
        release=long_decode or (kind != "full" and draw(st.sampled_from([True, True, True, False]))),
        table_as_mapping=draw(st.booleans()),
        shuffle_seed=draw(st.one_of(st.none(), st.integers(0, 1000))),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_matches_dense_reference(case: Case):
    d = _Driver(case)
    assert d.run() <= TOL
    event(f"kind={case.layer.kind}, page_table={case.page_table}, sink={case.layer.sink}")
    event(f"steps={min(len(case.steps), 3)}+, released pages={d.num_released > 0}")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(long_decode=True))
def test_long_decode_past_window_with_released_pages(case: Case):
    d = _Driver(case)
    assert d.run() <= TOL
    event(f"released pages={d.num_released > 0}")


# ---------------------------------------------------------------- named edge cases


def test_one_token_sequence():
    layer = make_layer(2, 4, 32, 16, sink="learnable")
    assert run_case(Case(layer, 16, [[(0, 1)]])) <= TOL


def test_window_zero_sees_only_self():
    layer = make_layer(2, 2, 16, 16, kind="sliding", window=0)
    case = Case(layer, 4, [[(0, 7), (1, 1)], [(0, 1), (1, 3)]])
    assert run_case(case) <= TOL
    # and directly: each query head returns its own token's value
    meta = PagedKVState(8, 4, 4).schedule([(0, 5)])
    kc, vc = allocate_kv_caches([layer], 8, 4)[0]
    rng = np.random.default_rng(1)
    q, k, v = (
        paddle.to_tensor(rng.standard_normal(s).astype("float32"))
        for s in ([5, 4, 16], [5, 2, 16], [5, 2, 16])
    )
    out = get_backend("reference").forward(q, k, v, layer, meta, (kc, vc)).numpy().reshape(5, 4, 16)
    np.testing.assert_allclose(out, np.repeat(v.numpy(), 2, axis=1), atol=1e-6)


def test_window_larger_than_sequence_is_full_attention():
    steps = [[(0, 10), (1, 3)], [(0, 1), (1, 1)]]
    layer = make_layer(1, 4, 32, 32, kind="sliding", window=1000)
    assert run_case(Case(layer, 16, steps, page_table=True, release=True)) <= TOL


def test_chunk_boundary_on_block_boundary():
    layer = make_layer(2, 4, 64, 32, kind="sliding", window=20, sink="off-by-one")
    # chunks of exactly one block, then decode starting a fresh block
    steps = [[(0, 16)], [(0, 16), (1, 32)], [(0, 1), (1, 1)], [(0, 15), (1, 16)], [(0, 1), (1, 1)]]
    assert run_case(Case(layer, 16, steps, release=True, shuffle_seed=7)) <= TOL


@pytest.mark.parametrize("sink_value", [1e4, -1e4])
def test_sink_far_above_and_below_every_score(sink_value):
    """A sink far above every score leaves ~zero output; far below, a plain softmax."""
    layer = make_layer(2, 2, 32, 16, sink="learnable")
    case = Case(layer, 16, [[(0, 6), (1, 1)], [(0, 1), (1, 2)]], sink_value=sink_value)
    assert run_case(case) <= TOL


def test_released_pages_filled_with_nan_are_never_read():
    """A long decode past the window on a head-wise layer: released pages are NaN and -1."""
    layer = make_layer(4, 2, 32, 32, kind="headwise", window=5, sliding=2, sink="learnable")
    steps = [[(0, 9), (1, 3)]] + [[(0, 1), (1, 1)]] * 30 + [[(0, 7), (1, 1)]]
    d = _Driver(Case(layer, 4, steps, page_table=True, release=True, shuffle_seed=3))
    assert d.run() <= TOL
    # sliding layer on a plain block table: whole blocks released
    sliding = make_layer(2, 4, 16, 16, kind="sliding", window=3, sink="off-by-one")
    assert run_case(Case(sliding, 2, steps, release=True, shuffle_seed=4)) <= TOL


def test_headwise_layer_without_page_table_uses_block_tables():
    layer = make_layer(4, 1, 16, 32, kind="headwise", window=2, sliding=3)
    steps = [[(0, 12), (1, 5)], [(0, 1), (1, 4)], [(0, 1), (1, 1)]]
    assert run_case(Case(layer, 4, steps, page_table=False)) <= TOL


def test_idle_slot_and_pure_decode_batch():
    layer = make_layer(2, 4, 32, 32, kind="sliding", window=4, sink="off-by-one")
    steps = [[(0, 5), (1, 0), (2, 9)], [(0, 1), (1, 3), (2, 1)], [(2, 1), (0, 1), (1, 1)]]
    assert run_case(Case(layer, 16, steps)) <= TOL


def test_torch_inputs_write_through_dlpack():
    pytest.importorskip("torch")
    layer = make_layer(2, 4, 32, 16, kind="headwise", window=3, sliding=1, sink="learnable")
    steps = [[(0, 6), (1, 2)], [(0, 1), (1, 1)], [(0, 1), (1, 1)]]
    assert run_case(Case(layer, 4, steps, page_table=True, torch_inputs=True)) <= TOL


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_cache_and_inputs(dtype):
    """fp16/bf16 q/k/v and cache: fp32 math, output in q's dtype (CPU gathers 16-bit floats as bits)."""
    layer = make_layer(2, 2, 32, 16, kind="headwise", window=2, sliding=1, sink="learnable")
    steps = [[(0, 7), (1, 2)], [(0, 1), (1, 3)], [(0, 1), (1, 1)]]
    assert run_case(Case(layer, 4, steps, page_table=True, release=True, dtype=dtype)) <= TOL


def test_fully_masked_row_gives_zeros():
    """No position a query can see (a key range after the query) gives 0, never NaN."""
    from fastdeploy_paddlefleet.backends.reference import _attend_run

    q = paddle.ones([1, 2, 3, 8])
    key = paddle.ones([1, 4, 8])
    value = paddle.ones([1, 4, 8])
    out = _attend_run(q, key, value, None, 0, 10, None, 0.5)
    assert np.array_equal(out.numpy(), np.zeros([1, 2, 3, 8]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_masked_keys_contribute_exactly_nothing(bad):
    """docs/semantics.md, "Masked keys": a non-finite K/V a query may not see (a later token of its
    own chunk, a key outside its window in a page still held) leaves its output as if the slot held
    zeros, bit for bit; a query that sees it gets a non-finite output, as dense attention gives."""
    layer = make_layer(2, 2, 16, 16, kind="sliding", window=5, sink="learnable")
    backend = get_backend("reference")
    sinks = paddle.to_tensor(np.linspace(-1, 1, 4).astype("float32"))
    rng = np.random.default_rng(3)

    def run(fill):
        state = PagedKVState(8, 4, 8, shuffle_seed=1)
        kc, vc = allocate_kv_caches([layer], 8, 4, fill=float("nan"))[0]
        outs = []
        for n, plant in (
            (12, None),
            (9, (4, 12 + 6)),
        ):  # step 2 plants key 4 (cache) and token 6 of the chunk
            meta = state.schedule([(0, n)])
            q, k, v = (
                paddle.to_tensor(rng.standard_normal(s).astype("float32"))
                for s in ([n, 4, 16], [n, 2, 16], [n, 2, 16])
            )
            if plant is not None:
                old, new = plant
                k[new - 12, 0] = fill  # this step's token: written with the rest
                v[new - 12, 0] = fill
                blk = int(meta.block_tables[0, old // 4])
                kc[blk, 0, old % 4] = fill
                vc[blk, 0, old % 4] = fill
            outs.append(backend.forward(q, k, v, layer, meta, (kc, vc), sinks).numpy().reshape(n, 4, 16))
        return outs[1]

    rng_state = rng.bit_generator.state
    zero = run(0.0)
    rng.bit_generator.state = rng_state
    got = run(bad)
    # kv head 0 (q heads 0, 1): chunk rows at positions 12.. see keys [pos - 5, pos]; key 4 is outside
    # every row's window; token 18 is seen by rows 18..20 only
    seen = np.zeros((9, 4), dtype=bool)
    seen[6:, :2] = True
    assert np.array_equal(got[~seen], zero[~seen])
    assert np.isfinite(zero).all()
    assert (~np.isfinite(got[seen])).any(axis=-1).all()
