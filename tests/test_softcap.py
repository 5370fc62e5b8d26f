"""Attention logit soft-capping (``LayerAttention.logits_soft_cap``) against the dense references.

The canonical math (HF ``modeling_gemma2.py`` ``eager_attention_forward``): scores ``s = scale * q.k``
become ``cap * tanh(s / cap)`` before the mask and the softmax; sinks are logits of their own and
are not capped. The references (``kernels/dense_reference.py``, ``tests/_dense_attention.py``)
apply exactly that with ``torch.tanh`` / ``np.tanh`` in float64; the kernels use their own tanh
(one ``exp2``). Triton runs under ``TRITON_INTERPRET=1`` on CPU (fp32 / fp16), compiled on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import test_triton_kernels as tk  # noqa: E402
from _dense_attention import dense_attention as np_dense  # noqa: E402

from fastdeploy_paddlefleet.kernels.dense_reference import dense_attention  # noqa: E402
from fastdeploy_paddlefleet.kernels.paged_attention import paged_attention  # noqa: E402

#: the first variant of each parametrized GPU test stays in ``-m gpu``, the rest are ``gpu_long``
#: (conftest.py: each compiles its own kernels)
GPU_LONG_VARIANTS = True
CAP = 5.0  # small enough that random scores (|s| up to ~4 with the boosted q below) are bent


def _capped(monkeypatch, cap: float | None) -> None:
    """Route ``run_and_check``'s dense reference through the soft cap."""
    monkeypatch.setattr(tk, "dense_attention", functools.partial(dense_attention, logits_soft_cap=cap))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if tk.CUDA else []))
@pytest.mark.parametrize(
    "attend",
    [
        dict(),
        dict(sink_kind="learnable"),
        dict(window_left=5, sink_kind="off-by-one"),
        dict(window_left=3, sliding_heads=(1, 2), sink_kind="learnable"),
    ],
)
def test_kernels_prefill_and_decode(monkeypatch, dtype, attend):
    _capped(monkeypatch, CAP)
    s = tk.make_step(
        [(9, 6), (20, 1), (0, 11), (3, 1)],
        hkv=2,
        group=2,
        dqk=32,
        dv=16,
        block_size=8,
        dtype=dtype,
        window_left=attend.get("window_left"),
        sliding_heads=attend.get("sliding_heads"),
    )
    s.q.mul_(3.0)  # scores of several units: the cap visibly bends them
    tk.run_and_check(s, logits_soft_cap=CAP, **attend)


@pytest.mark.gpu
@tk.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gemma2_shapes(monkeypatch, dtype):
    """Gemma-2-9B attention shapes (16 q / 8 kv heads, head dim 256, window 4095 on the sliding
    layers, cap 50, scale 256 ** -0.5), chunked prefill and decode, compiled on the GPU."""
    _capped(monkeypatch, 50.0)
    for window in (None, 255):  # 255: a short window so the test's contexts cross it
        s = tk.make_step(
            [(300, 200), (1000, 1), (0, 257), (70, 1)],
            hkv=8, group=2, dqk=256, dv=256, block_size=64, dtype=dtype, window_left=window,
        )  # fmt: skip
        s.q.mul_(4.0)  # scores of tens: the cap of 50 bends them
        tk.run_and_check(s, scale=256**-0.5, window_left=window, logits_soft_cap=50.0)


@pytest.mark.parametrize("splits", [1, 4])
def test_split_kv_decode_with_sinks(monkeypatch, splits):
    """The cap applies per split; the sink joins once in the reduce, uncapped."""
    _capped(monkeypatch, CAP)
    s = tk.make_step([(150, 1), (70, 1)], hkv=2, group=4, dqk=16, dv=16, block_size=16)
    s.q.mul_(3.0)
    tk.run_and_check(s, logits_soft_cap=CAP, sink_kind="learnable", num_splits=splits)


def test_huge_scores_stay_finite_and_match(monkeypatch):
    """Scores of order 1e4 (scale 1): tanh saturates to +-1, no overflow, no NaN."""
    _capped(monkeypatch, 30.0)
    s = tk.make_step([(5, 7), (12, 1)], hkv=1, group=2, dqk=16, dv=16, block_size=8)
    s.q.mul_(1000.0)
    tk.run_and_check(s, scale=1.0, logits_soft_cap=30.0)


def test_cap_changes_the_output():
    """The switch is not a no-op: capped and uncapped outputs differ on the same step."""
    s = tk.make_step([(4, 5)], hkv=1, group=2, dqk=16, dv=16, block_size=8)
    s.q.mul_(3.0)
    tk.write_kv_cache(s.k, s.v, s.key_cache, s.value_cache, s.bid, s.cu, s.dec, s.table, headwise=False)
    args = (s.q, s.key_cache, s.value_cache, s.cu, s.dec, s.table)
    plain = paged_attention(*args, scale=0.25)
    capped = paged_attention(*args, scale=0.25, logits_soft_cap=1.0)
    assert (plain - capped).abs().max() > 1e-2


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_cap_is_refused(bad):
    s = tk.make_step([(0, 2)], hkv=1, group=1, dqk=16, dv=16, block_size=8)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        paged_attention(
            s.q, s.key_cache, s.value_cache, s.cu, s.dec, s.table, scale=0.25, logits_soft_cap=bad
        )


# ------------------------------------------------------------------------------ backends


def test_reference_backend_against_numpy_dense(monkeypatch):
    """The reference backend's capped scores over several chunked steps vs numpy float64."""
    import test_reference_backend as trb  # needs paddle (skips without it)

    monkeypatch.setattr(trb, "dense_attention", functools.partial(np_dense, logits_soft_cap=2.0))
    for kind, window, sink in (("full", None, "vanilla"), ("sliding", 3, "learnable")):
        layer = dataclasses.replace(
            trb.make_layer(2, 2, 16, 8, kind=kind, window=window, sink=sink), logits_soft_cap=2.0
        )
        case = trb.Case(layer=layer, block_size=4, steps=[[(0, 6), (1, 3)], [(0, 1), (1, 4)], [(0, 1)]])
        assert trb.run_case(case) <= trb.TOL


def test_triton_backend_matches_reference_backend():
    """Both backends run the plan's cap (paddle inputs, CPU); neither differs from the other."""
    paddle = pytest.importorskip("paddle")
    from fastdeploy_paddlefleet.backends import get_backend
    from fastdeploy_paddlefleet.backends.base import BatchMeta

    layer = dataclasses.replace(tk._layer(2, 2, 32, 16, kind="sliding", window=4), logits_soft_cap=3.0)
    s = tk.make_step([(12, 5), (30, 1), (0, 9)], hkv=2, group=2, dqk=32, dv=16, block_size=8, window_left=4)
    s.q.mul_(3.0)
    meta_t = tk._meta(s, 8)

    def to_pd(x):
        return paddle.to_tensor(x.numpy())

    fields = meta_t.__dataclass_fields__
    meta = BatchMeta(
        **{f: to_pd(v) if isinstance(v := getattr(meta_t, f), torch.Tensor) else v for f in fields}
    )
    outs = []
    for name in ("reference", "triton"):
        kv = (to_pd(s.key_cache), to_pd(s.value_cache))
        outs.append(get_backend(name).forward(to_pd(s.q), to_pd(s.k), to_pd(s.v), layer, meta, kv).numpy())
    np.testing.assert_allclose(outs[1], outs[0], atol=2e-5, rtol=1e-4)
    # and the reference backend against the float64 dense reference with the cap
    for b, (lo, hi) in enumerate([(0, 5), (5, 6), (6, 15)]):
        want = dense_attention(
            s.q[lo:hi],
            s.hist_k[b],
            s.hist_v[b],
            scale=layer.softmax_scale,
            window_left=4,
            logits_soft_cap=3.0,
        )
        np.testing.assert_allclose(outs[0][lo:hi], want.reshape(hi - lo, -1).numpy(), atol=2e-5, rtol=1e-4)


def test_dense_references_agree():
    """The torch and numpy dense references implement the same capped math (independent code)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(*sh, generator=gen, dtype=torch.float64) * 3 for sh in ((4, 4, 8), (9, 2, 8), (9, 2, 8))
    )
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    got = dense_attention(
        q, k, v, scale=0.5, window_left=3, sink_kind="learnable", sinks=sinks, logits_soft_cap=2.0
    )
    want = np_dense(
        q.numpy(),
        k.numpy(),
        v.numpy(),
        5,
        scale=0.5,
        windows=[3, 3],
        sinks=sinks.numpy(),
        logits_soft_cap=2.0,
    )
    np.testing.assert_allclose(got.reshape(4, -1).numpy(), want, atol=1e-12)
    # capping at a huge cap is (numerically) no capping
    uncapped = dense_attention(q, k, v, scale=0.5, window_left=3, sink_kind="learnable", sinks=sinks)
    huge = dense_attention(
        q, k, v, scale=0.5, window_left=3, sink_kind="learnable", sinks=sinks, logits_soft_cap=1e9
    )
    torch.testing.assert_close(huge, uncapped, atol=1e-9, rtol=1e-9)
    assert math.isclose(float(torch.tanh(torch.tensor(50.0 / 50.0)) * 50.0), 38.0797, rel_tol=1e-4)


def test_paddleformers_has_no_soft_capping_model_so_patching_one_is_refused():
    """PaddleFormers 1.2.0: no model applies attention soft-capping (gemma3_text stores
    attn_logit_softcapping in its config but its attention never reads it), so there is no
    parity case; a plan that caps is refused at patch time instead of silently diverging."""
    pytest.importorskip("paddleformers")
    from fastdeploy_paddlefleet.backends import get_backend
    from fastdeploy_paddlefleet.patch.paddleformers import patch_paddleformers
    from fastdeploy_paddlefleet.plan import plan_from_config
    from fastdeploy_paddlefleet.runner.paddleformers_case import build_twins, tiny_config

    config = tiny_config("gemma3_text", attn_logit_softcapping=30.0, num_hidden_layers=2)
    plan = plan_from_config(config)
    assert {x.logits_soft_cap for x in plan} == {30.0}
    _, twin = build_twins(config)
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        patch_paddleformers(twin, plan, get_backend("reference"))
