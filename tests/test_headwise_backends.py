"""The backends driven by the head-wise manager's page tables on a head-wise layer.

Two requests decode far past the sliding heads' window in a page pool too small to hold them
without recycling. Every page the manager releases (and every page of a finished request) is
filled with NaN at once, so a read of a released page shows up as NaN. Each step's output must
match the same schedule without recycling (a pool big enough for everything) and a dense float64
reference over the request's whole K/V history.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from _dense_attention import dense_attention

torch = pytest.importorskip("torch")
pytest.importorskip("paddle")
if not torch.cuda.is_available():  # before the kernels are defined: @triton.jit reads it then
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastdeploy_paddlefleet.backends import get_backend  # noqa: E402
from fastdeploy_paddlefleet.kvcache.headwise import HeadwiseKVManager  # noqa: E402
from fastdeploy_paddlefleet.plan.layer import AttentionPlan, LayerAttention  # noqa: E402
from fastdeploy_paddlefleet.runner.batch import build_meta  # noqa: E402

HKV, GROUP, DQK, DV, WINDOW, BS = 2, 2, 8, 4, 5, 4
LAYER = LayerAttention(
    index=3,
    kind="headwise",
    num_q_heads=HKV * GROUP,
    num_kv_heads=HKV,
    qk_head_dim=DQK,
    v_head_dim=DV,
    softmax_scale=1.0 / math.sqrt(DQK),
    window_left=WINDOW,
    sliding_kv_heads=(1, 2),  # kv head 0 full, kv head 1 slides
    sink="learnable",
)
# (request, new tokens) per step: a prefill, a chunked prefill of b next to a's decode, long decodes,
# a finishes, b goes on alone
SCHEDULE = (
    [[("a", 7)], [("a", 1), ("b", 2)], [("a", 1), ("b", 3)]] + [[("a", 1), ("b", 1)]] * 24 + [[("b", 1)]] * 8
)
FINISH_A_AFTER = 27  # steps


def backends() -> list:
    names = ["reference"]
    try:
        import triton  # noqa: F401

        from fastdeploy_paddlefleet.backends import triton as _triton  # noqa: F401

        names.append("triton")
    except ImportError:
        pass
    return names


def run(backend_name: str, mode: str, num_blocks: int, nan_released: bool, seed: int = 0):
    """Outputs per step (numpy) and the dense reference per step."""
    rng = np.random.default_rng(seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = get_backend(backend_name)
    mgr = HeadwiseKVManager(AttentionPlan((LAYER,)), num_blocks, BS, mode=mode)
    fill = float("nan")
    kc = torch.full((num_blocks, HKV, BS, DQK), fill, dtype=torch.float32, device=device)
    vc = torch.full((num_blocks, HKV, BS, DV), fill, dtype=torch.float32, device=device)
    sinks = rng.standard_normal(HKV * GROUP).astype(np.float32)
    history = {}  # request -> (k [L, Hkv, Dqk], v [L, Hkv, Dv]) numpy
    outs, refs = [], []

    def owned() -> set[int]:
        reqs = mgr.requests
        if not reqs:
            return set()
        t = mgr.tables(reqs)[LAYER.index]
        return {int(p) for p in t.reshape(-1) if p >= 0}

    def poison(pages: set[int]) -> None:
        for p in pages:
            kc[p // HKV, p % HKV] = fill
            vc[p // HKV, p % HKV] = fill

    for step, batch in enumerate(SCHEDULE):
        if step == FINISH_A_AFTER:
            before = owned()
            mgr.finish("a")
            if nan_released:
                poison(before - owned())
        ids = [rid for rid, _ in batch]
        dec = []
        for rid, n in batch:
            if rid not in mgr:
                mgr.admit(rid)
            dec.append(mgr.num_tokens(rid))
            result = mgr.append(rid, n, computed=dec[-1])
            assert result.ok, (step, rid, result)
        this = [n for _, n in batch]
        t = sum(this)
        q = rng.standard_normal((t, HKV * GROUP, DQK)).astype(np.float32)
        k = rng.standard_normal((t, HKV, DQK)).astype(np.float32)
        v = rng.standard_normal((t, HKV, DV)).astype(np.float32)
        tables = mgr.tables(ids)
        meta = build_meta(
            dec, this, np.full((len(ids), 1), -1, dtype=np.int32), BS, block_tables_headwise=tables
        )
        out = backend.forward(
            torch.from_numpy(q).to(device),
            torch.from_numpy(k).to(device),
            torch.from_numpy(v).to(device),
            LAYER,
            meta,
            (kc, vc),
            sinks=torch.from_numpy(sinks).to(device),
        )
        outs.append(out.detach().cpu().numpy())
        ref, start = [], 0
        for (rid, n), d in zip(batch, dec, strict=True):
            hk, hv = history.get(rid, (np.zeros((0, HKV, DQK)), np.zeros((0, HKV, DV))))
            hk, hv = np.concatenate([hk, k[start : start + n]]), np.concatenate([hv, v[start : start + n]])
            history[rid] = (hk, hv)
            windows = [LAYER.head_window(h) for h in range(HKV)]
            ref.append(
                dense_attention(
                    q[start : start + n], hk, hv, d, scale=LAYER.softmax_scale, windows=windows, sinks=sinks
                )
            )
            start += n
        refs.append(np.concatenate(ref))
        before = owned()
        for rid in ids:
            mgr.release(rid, mgr.num_tokens(rid))
        if nan_released:
            poison(before - owned())
    return outs, refs, mgr


@pytest.mark.parametrize("backend_name", backends())
def test_recycled_decode_matches_no_recycling(backend_name):
    # 13 blocks = 26 pages; without recycling a (33 tokens) and b (29 then) need 2 x (9 + 8) = 34
    outs, refs, mgr = run(backend_name, "headwise", num_blocks=13, nan_released=True)
    base, _, _ = run(backend_name, "none", num_blocks=24, nan_released=False)
    for step, (o, b, r) in enumerate(zip(outs, base, refs, strict=True)):
        assert np.isfinite(o).all(), f"step {step}: a released page was read"
        assert np.abs(o - b).max() <= 1e-5, step
        assert np.abs(o - r).max() <= 1e-5, step
    assert mgr.num_tokens("b") == 2 + 3 + 24 + 8
    full = -(-mgr.num_tokens("b") // BS)
    assert mgr.request_pages("b")[0] < HKV * full  # the sliding head gave its old pages back


def test_small_pool_needs_recycling():
    """The same schedule does not fit the small pool without recycling (the test above is not vacuous)."""
    with pytest.raises(AssertionError):
        run("reference", "none", num_blocks=13, nan_released=False)
