"""The Hopper (Gluon, warp-specialised) prefill kernel against the dense reference, and its selection.

The kernel cases need an sm_90 GPU with Gluon (marked ``gpu``; skipped elsewhere, the interpreter
cannot run Gluon). They reuse ``make_step`` / ``run_and_check`` of ``test_triton_kernels``: a
NaN-filled cache with shuffled blocks, released pages (-1, NaN-filled), this step's K/V written by
the cache-write kernel, every request compared with the dense reference. The selection and
env-switch cases run everywhere.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from test_triton_kernels import REAL, make_step, run_and_check  # noqa: E402

from fastdeploy_paddlefleet import envs  # noqa: E402
from fastdeploy_paddlefleet.kernels import hopper_prefill as hp  # noqa: E402
from fastdeploy_paddlefleet.kernels.hopper_support import triton_tested  # noqa: E402

CUDA = torch.cuda.is_available()
HOPPER = CUDA and hp.is_hopper(torch.device("cuda")) and hp.gluon_available()
hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU and triton.experimental.gluon")
#: ``FDFLEET_PREFILL_KERNEL=auto`` picks the Hopper kernel on a tested Triton only (hopper_support.py)
AUTO_HOPPER = HOPPER and triton_tested()
#: the first variant of each parametrized test stays in ``-m gpu``, the rest are ``gpu_long`` (conftest.py)
GPU_LONG_VARIANTS = True

# chunked prefills with context, a short tail tile, two-token requests, decode rows in the same batch
MIXED = [(1000, 700), (0, 513), (37, 1), (2000, 1), (64, 64), (5, 2), (130, 77)]


def _hopper_tiles(monkeypatch, **kw) -> None:
    """Plans built in this test run the Hopper kernel as ``HopperPlan(**kw)``; a fresh plan memo, so no
    plan memoised by an earlier call (same cache addresses, other tiles) answers instead."""
    import functools

    from fastdeploy_paddlefleet.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "HopperPlan", functools.partial(hp.HopperPlan, **kw))
    if hasattr(pa, "_PLANS"):
        monkeypatch.setattr(pa, "_PLANS", type(pa._PLANS)())


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "attend",
    [
        dict(),
        dict(sink_kind="learnable"),
        dict(window_left=200, sink_kind="learnable"),
        dict(window_left=0, sink_kind="off-by-one"),
        dict(window_left=1023),
    ],
    ids=["causal", "sinks", "window-sinks", "window0-offbyone", "window1023"],
)
def test_hopper_prefill_features(dtype, attend):
    window = attend.get("window_left")
    s = make_step(MIXED, dtype=dtype, window_left=window, release=window is not None, seed=11, **REAL)
    run_and_check(s, prefill_impl="hopper", max_q_len=700, max_context_len=2001, **attend)


@pytest.mark.gpu_long  # -m gpu stays under 5 minutes: run with -m gpu_long
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 64, 128])
def test_hopper_prefill_headwise_tables_and_block_sizes(dtype, block_size):
    """Head-wise tables with per-head released pages, sliding on half the kv heads."""
    cfg = dict(REAL, block_size=block_size)
    kw = dict(window_left=150, sliding_heads=(4, 8))
    s = make_step(MIXED, dtype=dtype, headwise=True, release=True, seed=12, **kw, **cfg)
    run_and_check(s, prefill_impl="hopper", sink_kind="learnable", **kw)


@pytest.mark.gpu_long  # -m gpu stays under 5 minutes: run with -m gpu_long
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "shape",
    [
        dict(hkv=16, group=1, dqk=128, dv=64),  # qk != v, no GQA
        dict(hkv=2, group=8, dqk=64, dv=64),
        dict(hkv=4, group=3, dqk=128, dv=64),  # group padded to 4
        dict(hkv=1, group=16, dqk=64, dv=128),
    ],
    ids=["g1-v64", "g8-d64", "g3-v64", "g16-v128"],
)
def test_hopper_prefill_dims_and_groups(dtype, shape):
    reqs = [(300, 260), (0, 129), (700, 1), (64, 3)]
    s = make_step(reqs, block_size=64, dtype=dtype, window_left=100, release=True, seed=13, **shape)
    run_and_check(s, prefill_impl="hopper", window_left=100, sink_kind="learnable", scale=0.1)
    s = make_step(reqs, block_size=64, dtype=dtype, seed=14, **shape)  # nothing released: full attention
    run_and_check(s, prefill_impl="hopper")


@pytest.mark.gpu
@hopper
def test_hopper_prefill_long_sequences():
    """A long prefill (many tiles per CTA, both stages reused many times) agrees with the reference."""
    s = make_step([(0, 4096), (3000, 1000)], dtype=torch.bfloat16, seed=14, **REAL)
    run_and_check(s, prefill_impl="hopper", max_q_len=4096)
    run_and_check(s, prefill_impl="portable", max_q_len=4096)


@pytest.mark.gpu_long  # -m gpu stays under 5 minutes: run with -m gpu_long
@hopper
@pytest.mark.parametrize("num_ctas", [1, 3])
def test_hopper_prefill_persistent_ctas_walk_many_items(monkeypatch, num_ctas):
    """Few persistent CTAs: each walks many (query tile, kv head) items, the K/V ring and the
    double-buffered Q carrying their phases across items of different lengths and windows."""
    _hopper_tiles(monkeypatch, num_ctas=num_ctas)
    s = make_step(MIXED, dtype=torch.bfloat16, window_left=300, release=True, seed=15, **REAL)
    run_and_check(s, prefill_impl="hopper", window_left=300, sink_kind="learnable")
    s = make_step(MIXED, dtype=torch.float16, seed=16, **REAL)
    run_and_check(s, prefill_impl="hopper")


# MLA-style (qk 192 / v 128, DeepSeek-V3 / MiMo) and 256-wide heads: other tiles (tile_for), Q and K
# held in 64-column parts for 192, a single Q buffer
WIDE = [
    dict(hkv=16, group=1, dqk=192, dv=128),
    dict(hkv=4, group=4, dqk=192, dv=128),
    dict(hkv=2, group=8, dqk=256, dv=256),
    dict(hkv=4, group=3, dqk=256, dv=256),
]
WIDE_IDS = ["mla-g1", "mla-g4", "d256-g8", "d256-g3"]


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("shape", WIDE, ids=WIDE_IDS)
@pytest.mark.parametrize(
    "attend",
    [dict(), dict(window_left=150, sink_kind="learnable"), dict(window_left=0, sink_kind="off-by-one")],
    ids=["causal", "window-sinks", "window0-offbyone"],
)
def test_hopper_prefill_wide_heads(shape, attend):
    """Chunked prefills with context, tails, decode rows; sliding layers with their released pages
    (-1, NaN-filled) against the dense reference."""
    window = attend.get("window_left")
    s = make_step(MIXED, block_size=64, dtype=torch.bfloat16, window_left=window, release=window is not None,
                  seed=21, **shape)  # fmt: skip
    run_and_check(s, prefill_impl="hopper", max_q_len=700, max_context_len=2001, **attend)


@pytest.mark.gpu_long  # -m gpu stays under 5 minutes: run with -m gpu_long
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [WIDE[1], WIDE[2]], ids=["mla-g4", "d256-g8"])
@pytest.mark.parametrize("block_size", [16, 128])
def test_hopper_prefill_wide_heads_headwise(dtype, shape, block_size):
    """Head-wise tables with per-head released pages, half the kv heads sliding, sinks."""
    kw = dict(window_left=120, sliding_heads=(shape["hkv"] // 2, shape["hkv"]))
    s = make_step(
        MIXED, block_size=block_size, dtype=dtype, headwise=True, release=True, seed=22, **kw, **shape
    )
    run_and_check(s, prefill_impl="hopper", sink_kind="learnable", **kw)


@pytest.mark.gpu_long  # -m gpu stays under 5 minutes: run with -m gpu_long
@hopper
@pytest.mark.parametrize(
    "shape, tiles",
    [
        (dict(hkv=8, group=4, dqk=128, dv=128), dict(block_n=64, num_stages=3)),
        (dict(hkv=16, group=1, dqk=192, dv=128), dict(block_n=64, q_bufs=2, num_stages=3)),
        (dict(hkv=16, group=1, dqk=192, dv=128), dict(num_ctas=2)),  # 1 Q buffer, many items per CTA
        (dict(hkv=4, group=3, dqk=256, dv=256), dict(num_ctas=3)),
        (dict(hkv=16, group=1, dqk=192, dv=128), dict(q_late=True, num_ctas=2)),
        (dict(hkv=8, group=4, dqk=128, dv=128), dict(q_late=True, num_ctas=3)),
    ],
    ids=["d128-n64-s3", "mla-n64-q2-s3", "mla-2ctas", "d256-3ctas", "mla-qlate", "d128-qlate"],
)
def test_hopper_prefill_tile_variants(monkeypatch, shape, tiles):
    """The tuning variants (64-key tiles, 3 stages, double-buffered Q for 192, Q loaded after the first
    K tile) and few persistent CTAs walking many items through one Q buffer: same results as the
    reference."""
    _hopper_tiles(monkeypatch, **tiles)
    s = make_step(MIXED, block_size=64, dtype=torch.bfloat16, window_left=300, release=True, seed=23, **shape)
    run_and_check(s, prefill_impl="hopper", window_left=300, sink_kind="learnable")
    s = make_step(MIXED, block_size=64, dtype=torch.bfloat16, seed=24, **shape)
    run_and_check(s, prefill_impl="hopper")


# schedule variants (HopperPlan keywords): the first key tile peeled off the loop so ptxas keeps the
# wgmma's asynchronous; FA3's ping-pong of the two consumer warpgroups on named barriers on top of it;
# round-robin item order; Q by plain loads and the output stored from the wgmma layout (the defaults before)
SCHEDULES = [dict(peel=False), dict(pingpong=True), dict(snake=False), dict(q_async=False, o_vec=False)]
SCHEDULE_IDS = ["unpeeled", "pingpong", "round-robin", "plain-q-store"]
_HW = dict(window_left=120, sliding_heads=(4, 8))
_BF, _FP = torch.bfloat16, torch.float16
SCHEDULE_CASES = [
    # (shape and step, attention keywords, HopperPlan extras); one dtype each (each compiles a kernel)
    (dict(REAL, reqs=MIXED, dtype=_FP), dict(), {}),  # causal, GQA 4, chunked prefills, 2-token, decode rows
    (dict(REAL, reqs=MIXED, window_left=300, release=True, dtype=_BF),
     dict(window_left=300, sink_kind="learnable"), {}),  # released (-1, NaN-filled) pages below the window
    (dict(WIDE[0], block_size=64, reqs=MIXED, dtype=_BF), dict(), {}),  # MLA 192 / 128, one Q buffer
    (dict(WIDE[3], block_size=64, reqs=MIXED, window_left=150, release=True, dtype=_FP),
     dict(window_left=150, sink_kind="learnable"), {}),  # 256 / 256, group 3 padded, 64-key tiles
    (dict(REAL, block_size=16, reqs=MIXED, headwise=True, release=True, dtype=_BF, **_HW),
     dict(sink_kind="learnable", **_HW), {}),  # head-wise tables, half the kv heads sliding
    # many uneven items per CTA through one Q buffer and a 3-stage ring (phases wrap at other points)
    (dict(REAL, reqs=MIXED + [(0, 1500)], dtype=_BF), dict(), dict(num_ctas=2, q_bufs=1, num_stages=3)),
    (dict(WIDE[1], block_size=64, reqs=MIXED, dtype=_BF), dict(sink_kind="off-by-one"), dict(num_ctas=3)),
]  # fmt: skip
SCHEDULE_CASE_IDS = ["causal", "window-sinks", "mla", "d256-window", "headwise-bs16", "2ctas-s3", "mla-3ctas"]


@pytest.mark.gpu_long  # -m gpu stays under 5 minutes: run with -m gpu_long
@hopper
@pytest.mark.parametrize("case", SCHEDULE_CASES, ids=SCHEDULE_CASE_IDS)
@pytest.mark.parametrize("schedule", SCHEDULES, ids=SCHEDULE_IDS)
def test_hopper_prefill_schedule_variants(monkeypatch, schedule, case):
    """The peeled and ping-pong schedules against the dense reference: causal, window + sinks with
    released pages, MLA, 256-wide heads, head-wise tables, few CTAs walking many items of uneven
    length (the consumers' turns must stay balanced across item boundaries, and a consumer whose
    half of a tile is all padding still takes its turns); bf16 and fp16."""
    step_kw, attend, extra = case
    step_kw = dict(step_kw)
    reqs = step_kw.pop("reqs")
    _hopper_tiles(monkeypatch, **schedule, **extra)
    s = make_step(reqs, seed=31, **step_kw)
    run_and_check(s, prefill_impl="hopper", **attend)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize(
    "shape", [dict(hkv=8, group=4, dqk=128, dv=128), WIDE[0], WIDE[2]], ids=["d128", "mla-g1", "d256-g8"]
)
@pytest.mark.parametrize(
    "attend", [dict(), dict(window_left=150, sink_kind="learnable")], ids=["causal", "window-sinks"]
)
def test_hopper_prefill_soft_cap(monkeypatch, shape, attend):
    """Soft-capping (``cap * tanh(s / cap)`` before the mask; sinks uncapped) on the Hopper kernel
    against the capped dense reference (HF Gemma-2's eager math, in float64 / float32)."""
    import functools

    import test_triton_kernels as tk

    from fastdeploy_paddlefleet.kernels.dense_reference import dense_attention

    cap = 5.0
    monkeypatch.setattr(tk, "dense_attention", functools.partial(dense_attention, logits_soft_cap=cap))
    window = attend.get("window_left")
    s = make_step(MIXED, block_size=64, dtype=torch.bfloat16, window_left=window, release=window is not None,
                  seed=25, **shape)  # fmt: skip
    s.q.mul_(3.0)  # scores of several units: the cap visibly bends them
    run_and_check(s, prefill_impl="hopper", logits_soft_cap=cap, **attend)
    # the capped scores are not the uncapped ones: the same step without the cap misses the reference
    with pytest.raises(AssertionError, match="relative error"):
        run_and_check(s, prefill_impl="hopper", **attend)


def test_tiles_fit_shared_memory():
    """Every head-dim pair the kernel accepts gets tiles that fit sm_90's 227 KB (hand-counted bytes
    of the Q buffers and the K/V ring), with the double-buffered Q and 128-key tiles whenever they fit."""
    want = {
        (64, 64): (128, 2, 2),
        (64, 128): (128, 2, 2),
        (128, 64): (128, 2, 2),
        (128, 128): (128, 2, 2),  # Q 2 x 32 KB + K/V 2 x 64 KB = 192 KB
        (192, 128): (128, 1, 2),  # Q 48 KB + K/V 2 x 80 KB = 208 KB (2 Q buffers: 256 KB)
        (256, 256): (64, 1, 2),  # Q 64 KB + K/V 2 x 64 KB = 192 KB
    }
    assert set(want) == set(hp.HEAD_DIMS)
    kb = {(128, 128): 192, (192, 128): 208, (256, 256): 192}
    for dims, tiles in want.items():
        assert hp.tile_for(*dims) == tiles
        assert hp.smem_bytes(*dims, *tiles) <= 227 * 1024
        if dims in kb:
            assert hp.smem_bytes(*dims, *tiles) == kb[dims] * 1024
    with pytest.raises(ValueError, match="512/512"):
        hp.tile_for(512, 512)
    # the default tiles leave room for the output's 16-byte stores (one consumer's 64 x Dv rows)
    for dims, tiles in want.items():
        assert hp.smem_bytes(*dims, *tiles) + hp.store_scratch_bytes(dims[1]) <= hp.SMEM_LIMIT, dims
    assert hp.store_scratch_bytes(128) == 16 * 1024 and hp.store_scratch_bytes(256) == 32 * 1024


@pytest.mark.skipif(not hp.gluon_available(), reason="needs triton.experimental.gluon (descriptors)")
def test_plan_stores_output_rows_where_shared_memory_allows():
    """``o_vec`` holds where its conversion fits beside the tiles; tuning tiles that fill shared memory
    (a third 128-key stage with one Q buffer: 224 KB) store from the wgmma layout instead (compiling the
    conversion there ran out of shared memory on the H200)."""
    kw = dict(
        qk_scale=0.1, sink_mode=0, headwise=False, has_window=False, window=0, win_h0=0, win_h1=4, num_ctas=4
    )
    kc = torch.zeros(2, 4, 64, 128, dtype=torch.bfloat16)
    assert hp.HopperPlan(kc, kc, 8, None, **kw).consts["O_VEC"] is True
    assert hp.HopperPlan(kc, kc, 8, None, q_bufs=1, num_stages=3, **kw).consts["O_VEC"] is False
    assert hp.HopperPlan(kc, kc, 8, None, o_vec=False, **kw).consts["O_VEC"] is False
    k192, v128 = (
        torch.zeros(2, 4, 64, 192, dtype=torch.bfloat16),
        torch.zeros(2, 4, 64, 128, dtype=torch.bfloat16),
    )
    assert hp.HopperPlan(k192, v128, 4, None, **kw).consts["O_VEC"] is True  # 208 + 16 KB
    assert (
        hp.HopperPlan(k192, v128, 4, None, block_n=64, q_bufs=2, num_stages=3, **kw).consts["O_VEC"] is False
    )


def test_prefill_kernel_env_switch_parses_strictly(monkeypatch):
    monkeypatch.delenv("FDFLEET_PREFILL_KERNEL", raising=False)
    assert envs.prefill_kernel() == "auto"
    for raw, want in ((" Portable ", "portable"), ("HOPPER", "hopper"), ("", "auto")):
        monkeypatch.setenv("FDFLEET_PREFILL_KERNEL", raw)
        assert envs.prefill_kernel() == want
    monkeypatch.setenv("FDFLEET_PREFILL_KERNEL", "fa3")
    with pytest.raises(ValueError, match="FDFLEET_PREFILL_KERNEL='fa3'"):
        envs.prefill_kernel()


def test_prefill_kernel_choice(monkeypatch):
    monkeypatch.delenv("FDFLEET_PREFILL_KERNEL", raising=False)
    dev = "cuda" if CUDA else "cpu"
    q = torch.zeros(4, 8, 128, dtype=torch.bfloat16, device=dev)
    kc = torch.zeros(2, 2, 64, 128, dtype=torch.bfloat16, device=dev)
    auto = hp.choose_prefill_impl(None, None, q, kc, kc)
    assert auto == ("hopper" if AUTO_HOPPER else "portable")
    assert hp.choose_prefill_impl("portable", None, q, kc, kc) == "portable"
    assert hp.choose_prefill_impl(None, object(), q, kc, kc) == "portable"  # explicit portable tiles
    monkeypatch.setenv("FDFLEET_PREFILL_KERNEL", "portable")
    assert hp.choose_prefill_impl(None, None, q, kc, kc) == "portable"
    monkeypatch.delenv("FDFLEET_PREFILL_KERNEL")
    with pytest.raises(ValueError, match="prefill_impl"):
        hp.choose_prefill_impl("gluon", None, q, kc, kc)
    # fp32 and head dims it was not built for never run on the Hopper kernel: asking names the reason
    with pytest.raises(ValueError, match="cannot run these inputs"):
        hp.choose_prefill_impl("hopper", None, q.float(), kc.float(), kc.float())
    q96 = torch.zeros(4, 8, 96, dtype=torch.bfloat16, device=dev)
    k96 = torch.zeros(2, 2, 64, 96, dtype=torch.bfloat16, device=dev)
    assert hp.choose_prefill_impl(None, None, q96, k96, kc) == "portable"
    with pytest.raises(ValueError, match="cannot run these inputs"):
        hp.choose_prefill_impl("hopper", None, q96, k96, kc)
    # MLA's 192 / 128 and 256 / 256 take the Hopper kernel where it exists
    q192 = torch.zeros(4, 8, 192, dtype=torch.bfloat16, device=dev)
    k192 = torch.zeros(2, 2, 64, 192, dtype=torch.bfloat16, device=dev)
    assert hp.choose_prefill_impl(None, None, q192, k192, kc) == ("hopper" if AUTO_HOPPER else "portable")
    q256 = torch.zeros(4, 8, 256, dtype=torch.bfloat16, device=dev)
    k256 = torch.zeros(2, 2, 64, 256, dtype=torch.bfloat16, device=dev)
    assert hp.choose_prefill_impl(None, None, q256, k256, k256) == ("hopper" if AUTO_HOPPER else "portable")
    assert hp.choose_prefill_impl(None, None, q192, k192, k256) == "portable"  # 192 / 256: not built


@pytest.mark.skipif(not hp.gluon_available(), reason="needs triton.experimental.gluon (descriptors)")
def test_plan_schedule_options_and_register_split():
    """``peel`` is the default; ``pingpong`` implies it (its turns need the unconditional waits); the
    register split is checked against the SM's 65536 registers (2 consumer warpgroups + the producer,
    128 threads each)."""
    kc = torch.zeros(2, 2, 64, 128, dtype=torch.bfloat16)
    kw = dict(
        qk_scale=0.1, sink_mode=0, headwise=False, has_window=False, window=0, win_h0=0, win_h1=0, num_ctas=4
    )
    plain = hp.HopperPlan(kc, kc, 8, None, **kw)
    assert (plain.consts["PEEL"], plain.consts["PINGPONG"], plain.consts["SNAKE"]) == (True, False, True)
    assert (plain.consts["CONSUMER_REGS"], plain.consts["PRODUCER_REGS"]) == (232, 40)
    pp = hp.HopperPlan(kc, kc, 8, None, pingpong=True, **kw)
    assert (pp.consts["PEEL"], pp.consts["PINGPONG"]) == (True, True)
    ok = hp.HopperPlan(kc, kc, 8, None, consumer_regs=240, producer_regs=24, **kw)  # 2*240*128 + 24*128
    assert ok.consts["CONSUMER_REGS"] == 240
    for regs in (dict(consumer_regs=248), dict(consumer_regs=236), dict(producer_regs=16)):
        with pytest.raises(ValueError, match="consumer_regs"):
            hp.HopperPlan(kc, kc, 8, None, **regs, **kw)


@pytest.mark.skipif(not hp.gluon_available(), reason="needs triton.experimental.gluon (descriptors)")
def test_plan_loads_unaligned_queries_without_cp_async():
    """A query view that starts off a 16-byte boundary (or whose strides Triton cannot prove 16-divisible)
    launches with plain Q loads: ``cp.async`` copies 16 bytes (a misaligned view failed on the H200,
    ``test_gpu_misaligned_views_take_tritons_path_and_stay_right``); aligned ones keep ``cp.async``."""

    class Recorder:  # stands in for a KernelCache: nothing kept, every launch through Triton's path
        addresses = True

        def __init__(self):
            self.consts = []

        def kernel(self, key):
            return None

        def launch(self, fn, key, grid, args, consts, stream):
            self.consts.append(consts)

    kw = dict(
        qk_scale=0.1, sink_mode=0, headwise=False, has_window=False, window=0, win_h0=0, win_h1=4, num_ctas=4
    )
    kc = torch.zeros(4, 4, 64, 128, dtype=torch.bfloat16)
    plan = hp.HopperPlan(kc, kc, 8, None, **kw)
    cu, dec, tbl = (
        torch.tensor([0, 8], dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        torch.zeros(1, 2),
    )
    out = torch.zeros(8, 8, 128, dtype=torch.bfloat16)
    aligned = torch.zeros(8, 8, 128, dtype=torch.bfloat16)
    shifted = torch.zeros(8 * 8 * 128 + 1, dtype=torch.bfloat16)[1:].view(8, 8, 128)
    wide = torch.zeros(8, 8, 144, dtype=torch.bfloat16)[:, :, :128]  # strides 1152 / 144: 16-divisible
    rec = Recorder()
    for q in (aligned, shifted, wide):
        plan.run(q, out, cu, dec, tbl.int(), None, rec, None, None, None)
    # two launches each (the fast one, then the safe one), both with the same Q loads
    assert [c["Q_ASYNC"] for c in rec.consts] == [True, True, False, False, True, True]
    assert [c.get("SAFE", False) for c in rec.consts] == [False, True] * 3
    wide2 = torch.zeros(8, 8, 136, dtype=torch.bfloat16)[:, :, :128]  # strides 1088 / 136: not
    plan.run(wide2, out, cu, dec, tbl.int(), None, rec, None, None, None)
    assert rec.consts[-1]["Q_ASYNC"] is False
