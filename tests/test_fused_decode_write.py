"""The cache write fused into the decode launch (``paged_attention(..., new_kv=(k, v))``, the backend's
decode-only steps): the same cache bytes as the separate write kernel, and the same attention as the
dense reference over each request's history (its new key included).

On CPU the kernels run under ``TRITON_INTERPRET=1``; with a CUDA GPU the same cases run compiled.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from test_triton_kernels import CUDA, DEVICE, REL_TOL, make_step  # noqa: E402  (sets TRITON_INTERPRET)

from fastdeploy_paddlefleet.kernels import paged_attention as pa  # noqa: E402
from fastdeploy_paddlefleet.kernels.cache_write import write_kv_cache  # noqa: E402
from fastdeploy_paddlefleet.kernels.dense_reference import dense_attention  # noqa: E402
from fastdeploy_paddlefleet.kernels.errors import KernelErrorMonitor, new_error_flag  # noqa: E402

# decode requests: (context already cached, 1 new token); an idle slot (0 new tokens) among them; the
# new tokens land in a fresh block (ctx % BS == 0), mid-block, and at a block's last slot
DECODE = [(16, 1), (37, 1), (5, 0), (0, 1), (47, 1), (130, 1)]
CASES = {
    "full": (dict(hkv=2, group=2, dqk=32, dv=32, block_size=16), dict()),
    "window-sinks": (
        dict(hkv=2, group=2, dqk=32, dv=32, block_size=16, window_left=20, release=True),
        dict(window_left=20, sink_kind="learnable"),
    ),
    "headwise-sliding": (
        dict(hkv=4, group=1, dqk=32, dv=32, block_size=8, headwise=True, window_left=9,
             sliding_heads=(0, 2), release=True),
        dict(window_left=9, sliding_heads=(0, 2), sink_kind="off-by-one"),
    ),
    "mla-dims": (dict(hkv=1, group=4, dqk=48, dv=32, block_size=16), dict()),
    "softcap": (dict(hkv=2, group=3, dqk=32, dv=32, block_size=16), dict(logits_soft_cap=5.0)),
}  # fmt: skip


def _sinks(kind, hq):
    if kind != "learnable":
        return None
    return (torch.randn(hq, generator=torch.Generator().manual_seed(3)) * 2).to(DEVICE)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_fused_write_matches_the_write_kernel_and_the_reference(name, dtype, splits):
    shape, attend = CASES[name]
    s = make_step(DECODE, dtype=dtype, seed=7, **shape)
    hq = s.q.shape[1]
    sink_kind = attend.pop("sink_kind", "vanilla")
    kw = dict(
        scale=0.3, headwise=s.headwise, sink_kind=sink_kind, sinks=_sinks(sink_kind, hq), max_q_len=1,
        num_splits=splits, **attend,
    )  # fmt: skip
    kc, vc = s.key_cache.clone(), s.value_cache.clone()  # the separate write, then the decode
    write_kv_cache(s.k, s.v, kc, vc, s.bid, s.cu, s.dec, s.table, headwise=s.headwise)
    want_out = pa.paged_attention(s.q, kc, vc, s.cu, s.dec, s.table, **kw)
    got = pa.paged_attention(s.q, s.key_cache, s.value_cache, s.cu, s.dec, s.table, new_kv=(s.k, s.v), **kw)
    assert torch.equal(s.key_cache.nan_to_num(7.0), kc.nan_to_num(7.0))  # the same bytes written
    assert torch.equal(s.value_cache.nan_to_num(7.0), vc.nan_to_num(7.0))
    tol = REL_TOL[dtype]
    for b, (_, n) in enumerate(s.reqs):
        if n == 0:
            continue
        row = int(s.cu[b])
        want = dense_attention(
            s.q[row : row + 1], s.hist_k[b], s.hist_v[b], scale=0.3,
            window_left=attend.get("window_left"), sliding_heads=attend.get("sliding_heads"),
            sink_kind=sink_kind, sinks=kw["sinks"], logits_soft_cap=attend.get("logits_soft_cap"),
            compute_dtype=torch.float64 if not CUDA else torch.float32,
        )  # fmt: skip
        o = got[row : row + 1].to(want.dtype)
        assert torch.isfinite(o).all(), b
        err = float((o - want).norm() / want.norm().clamp_min(1e-6))
        assert err <= tol, (b, err)
        # and the unfused decode agrees to the rounding of one P @ V term
        assert torch.allclose(got[row].float(), want_out[row].float(), rtol=tol, atol=tol), b


def test_fused_write_is_for_decode_only_steps_and_checks_its_tensors():
    s = make_step([(16, 1), (3, 2)], hkv=2, group=2, dqk=32, dv=32, block_size=16)
    args = (s.q, s.key_cache, s.value_cache, s.cu, s.dec, s.table)
    for mq in (2, None):
        with pytest.raises(ValueError, match="max_q_len=1"):
            pa.paged_attention(*args, scale=0.3, max_q_len=mq, new_kv=(s.k, s.v))
    d = make_step([(16, 1), (3, 1)], hkv=2, group=2, dqk=32, dv=32, block_size=16)
    args = (d.q, d.key_cache, d.value_cache, d.cu, d.dec, d.table)
    for bad in ((d.k[:, :1], d.v), (d.k, d.v[:, :, :16]), (d.k[:1], d.v), (d.k.transpose(1, 2), d.v)):
        with pytest.raises(ValueError, match="new_kv must be"):
            pa.paged_attention(*args, scale=0.3, max_q_len=1, new_kv=bad)


def test_fused_write_records_a_bad_entry_as_the_cache_write():
    """The new token opens a block that is missing from the table (-1): nothing is written for it, the
    request's output is the attention over its cached keys alone, and the error flag names the cache
    write (the only one that needs that block: every cached key lies in the blocks before it)."""
    s = make_step([(16, 1), (32, 1)], hkv=2, group=2, dqk=32, dv=32, block_size=16, seed=2)
    s.table[1, 32 // 16] = -1  # request 1's new token (position 32) has no block
    flag = new_error_flag(s.q)
    kc0 = s.key_cache.clone()
    out = pa.paged_attention(
        s.q, s.key_cache, s.value_cache, s.cu, s.dec, s.table, scale=0.3, max_q_len=1, errors=flag,
        new_kv=(s.k, s.v),
    )  # fmt: skip
    changed = (s.key_cache.nan_to_num(7.0) != kc0.nan_to_num(7.0)).any(dim=-1).nonzero().tolist()
    assert len(changed) == 2  # request 0's new key, in both kv heads; nothing of request 1's
    with pytest.raises(ValueError, match="request 1") as e:
        KernelErrorMonitor(flag).check()
    assert "write" in str(e.value) and "logical block 2" in str(e.value)
    assert torch.isfinite(out).all()
    want = dense_attention(s.q[1:2], s.hist_k[1][:32], s.hist_v[1][:32], scale=0.3)  # without its new key
    assert torch.allclose(out[1:2].to(want.dtype), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate-write"])
def test_backend_decode_steps_write_in_the_decode_launch(monkeypatch, fused):
    """A decode-only step through the Triton backend (head-wise sliding heads, learnable sinks): with
    ``FDFLEET_FUSED_DECODE_WRITE`` on (default) the cache-write plan never runs, and the caches and
    output match the separate write's; a mixed step still runs the write."""
    from test_triton_kernels import _layer, _meta

    from fastdeploy_paddlefleet.backends.triton import TritonBackend
    from fastdeploy_paddlefleet.kernels import cache_write

    monkeypatch.setenv("FDFLEET_FUSED_DECODE_WRITE", "1" if fused else "off")
    writes = []
    run_step = cache_write.CacheWritePlan.run_step
    monkeypatch.setattr(
        cache_write.CacheWritePlan,
        "run_step",
        lambda self, *a, **k: (writes.append(1), run_step(self, *a, **k)),
    )
    layer = _layer(2, 4, 32, 16, kind="headwise", window=12, sliding=(1, 2), sink="learnable")
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    backend = TritonBackend(validate=True, host_checks=False)
    for reqs, seed in (([(9, 1), (40, 1), (3, 0), (16, 1)], 4), ([(9, 4), (20, 1)], 5)):
        s = make_step(
            reqs, hkv=2, group=4, dqk=32, dv=16, block_size=8, headwise=True, window_left=12,
            sliding_heads=(1, 2), release=True, seed=seed,
        )  # fmt: skip
        kc, vc = s.key_cache.clone(), s.value_cache.clone()
        writes.clear()
        out = backend.forward(s.q, s.k, s.v, layer, _meta(s, 8), (s.key_cache, s.value_cache), sinks)
        decode_only = max(n for _, n in reqs) == 1
        assert len(writes) == (0 if fused and decode_only else 1)
        write_kv_cache(s.k, s.v, kc, vc, s.bid, s.cu, s.dec, s.table, headwise=True)
        assert torch.equal(s.key_cache.nan_to_num(7.0), kc.nan_to_num(7.0))
        assert torch.equal(s.value_cache.nan_to_num(7.0), vc.nan_to_num(7.0))
        want = pa.paged_attention(
            s.q, kc, vc, s.cu, s.dec, s.table, scale=layer.softmax_scale, headwise=True, window_left=12,
            sliding_heads=(1, 2), sink_kind="learnable", sinks=sinks,
        )  # fmt: skip
        assert torch.allclose(out.view_as(want), want, rtol=1e-5, atol=1e-5)
