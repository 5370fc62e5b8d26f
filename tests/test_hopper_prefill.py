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

CUDA = torch.cuda.is_available()
HOPPER = CUDA and hp.is_hopper(torch.device("cuda")) and hp.gluon_available()
hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU and triton.experimental.gluon")

# chunked prefills with context, a short tail tile, two-token requests, decode rows in the same batch
MIXED = [(1000, 700), (0, 513), (37, 1), (2000, 1), (64, 64), (5, 2), (130, 77)]


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


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 64, 128])
def test_hopper_prefill_headwise_tables_and_block_sizes(dtype, block_size):
    """Head-wise tables with per-head released pages, sliding on half the kv heads."""
    cfg = dict(REAL, block_size=block_size)
    kw = dict(window_left=150, sliding_heads=(4, 8))
    s = make_step(MIXED, dtype=dtype, headwise=True, release=True, seed=12, **kw, **cfg)
    run_and_check(s, prefill_impl="hopper", sink_kind="learnable", **kw)


@pytest.mark.gpu
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


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("num_ctas", [1, 3])
def test_hopper_prefill_persistent_ctas_walk_many_items(monkeypatch, num_ctas):
    """Few persistent CTAs: each walks many (query tile, kv head) items, the K/V ring and the
    double-buffered Q carrying their phases across items of different lengths and windows."""
    import functools

    from fastdeploy_paddlefleet.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "HopperPlan", functools.partial(hp.HopperPlan, num_ctas=num_ctas))
    s = make_step(MIXED, dtype=torch.bfloat16, window_left=300, release=True, seed=15, **REAL)
    run_and_check(s, prefill_impl="hopper", window_left=300, sink_kind="learnable")
    s = make_step(MIXED, dtype=torch.float16, seed=16, **REAL)
    run_and_check(s, prefill_impl="hopper")


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
    assert auto == ("hopper" if HOPPER else "portable")
    assert hp.choose_prefill_impl("portable", None, q, kc, kc) == "portable"
    assert hp.choose_prefill_impl(None, object(), q, kc, kc) == "portable"  # explicit portable tiles
    monkeypatch.setenv("FDFLEET_PREFILL_KERNEL", "portable")
    assert hp.choose_prefill_impl(None, None, q, kc, kc) == "portable"
    with pytest.raises(ValueError, match="prefill_impl"):
        hp.choose_prefill_impl("gluon", None, q, kc, kc)
    # fp32 and MLA's 192-wide keys never run on the Hopper kernel: asking for it names the reason
    with pytest.raises(ValueError, match="cannot run these inputs"):
        hp.choose_prefill_impl("hopper", None, q.float(), kc.float(), kc.float())
    q192 = torch.zeros(4, 8, 192, dtype=torch.bfloat16, device=dev)
    k192 = torch.zeros(2, 2, 64, 192, dtype=torch.bfloat16, device=dev)
    assert hp.choose_prefill_impl(None, None, q192, k192, kc) == "portable"
    with pytest.raises(ValueError, match="cannot run these inputs"):
        hp.choose_prefill_impl("hopper", None, q192, k192, kc)
