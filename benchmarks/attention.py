"""Paged-attention benchmark on one GPU: the Triton kernels against the peers a user would pick.

Cases (bf16, block size 64, 32 q heads / 8 kv heads, head 128 unless stated), as in issue 4:

* decode: batch 64 x context 4096 (the query is position 4095): full; sliding 1024; sliding 1024 +
  sinks; head-wise (half the kv heads sliding 1024, their out-of-window pages released to -1);
* prefill: one 8192-token sequence: causal; sliding 1024; sliding 1024 + sinks;
* mixed: 32 decodes at context 4096 + one 2048-token prefill chunk, one packed batch;
* MLA-style: qk 192 / v 128, 16 heads, no GQA: decode (64 x 4096) and prefill (8192).

"Sliding 1024" is ``window_left = 1023``: every query sees 1024 keys (itself included).

Metrics. Decode: effective bandwidth = bytes of K and V the queries actually need (each visible key
row of each kv head once: ``sum over requests and kv heads of visible_keys * (Dqk + Dv) * 2 B``) /
time. Prefill: TFLOP/s = ``2 * visible_pairs * (Dqk + Dv) * Hq / time`` where ``visible_pairs``
counts only the (query, key) pairs the causal / window mask keeps (for causal ``N(N+1)/2``; for a
window W ``sum_i min(i + 1, W)``): work on masked-out pairs is not credited. Peers run in the same
process: torch SDPA (cuDNN and flash backends, contiguous KV), FlexAttention (the same masks; sinks
via ``out * sigmoid(lse - sink)``) and the HBM copy bandwidth (bytes read + written). Times are the
median of ``triton.testing.do_bench`` (L2 flushed before each run) on fresh random inputs with a
random permutation of the physical blocks.

Usage::

    python benchmarks/attention.py [--out FILE.jsonl] [--cases decode,prefill,...] [--sweep]
    python benchmarks/attention.py --plot-only FILE.jsonl     # draw the PNG from saved JSON lines
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
if HERE not in sys.path:  # also when loaded by file path (the tests)
    sys.path.insert(0, HERE)
from _outputs import (  # noqa: E402
    Claim,
    RecordFile,
    Refused,
    claim,
    device_problem,
    fail,
    force_help,
    output_path,
    plot_path,
    read_jsonl,
    replacing,
)

SCRIPT = "attention"  # the mark on what this script writes (benchmarks/_outputs.py)

BS, HQ, HKV, D = 64, 32, 8, 128
# shapes of issue 4; ``--smoke`` shrinks them to check the script on CPU (interpreter) or a small GPU
SH = dict(bsz=64, ctx=4096, n=8192, window=1023, mixed=(32, 4096, 2048), dev="cuda", dtype="bfloat16")
SMOKE = dict(bsz=3, ctx=200, n=150, window=63, mixed=(2, 200, 100), dev="cpu", dtype="float32")
DEFAULT_OUT = os.path.join(HERE, "results", "attention-h200.jsonl")
RECORDS: list[dict] = []
#: FlexAttention among the peers (``--no-flex``: SDPA only; Flex compiles for about a minute per mask)
FLEX = True
#: quantized KV cache formats timed beside each case's unquantized run (``--kv-cache-quant``): records
#: ``impl: triton-<format>``, ``kv_cache_dtype: <format>``, ``vs_bf16`` (the unquantized run's ms over
#: this one's); the unquantized records keep their meaning and carry ``kv_cache_dtype: <dtype>``
KV_QUANTS: list[str] = []
KV_QUANT_CHOICES = ("none", "block_wise_fp8", "float8_e4m3fn", "int8")


#: the launch modules by their names since ``kernels/launch/`` (issue 30) and before (an older tree
#: benchmarked with ``--src``: ``kernels/_launch.py``, ``kernels/_cuda_launch.py``)
LAUNCH_MODULES = {"direct": "_launch", "own_launcher": "_cuda_launch", "c_entry": "_fast_launch"}


def launch_module(name: str):
    """``fastdeploy_paddlefleet.kernels.launch.<name>``, or its older flat name in the tree on ``sys.path``
    (``--src``); ``ImportError`` if the tree has neither."""
    import importlib

    try:
        return importlib.import_module(f"fastdeploy_paddlefleet.kernels.launch.{name}")
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("fastdeploy_paddlefleet.kernels.launch"):
            raise
        return importlib.import_module(f"fastdeploy_paddlefleet.kernels.{LAUNCH_MODULES[name]}")


def emit(rec: dict, fh: RecordFile | None = None) -> None:
    """Keep ``rec``, print it, and write it (with its script's mark) into ``fh``."""
    RECORDS.append(rec)
    print(json.dumps(rec), flush=True)
    if fh is not None:
        fh.record(rec)


# ------------------------------------------------------------------------------ inputs


def paged_batch(ctx_lens, q_lens, hq, hkv, dqk, dv, *, window=None, sliding=None, headwise=False, seed=0):
    """Random paged cache holding every request's keys ``0..ctx+q-1`` (shuffled physical blocks),
    queries for the last ``q`` positions, and the metadata. Head-wise: page tables whose sliding
    heads' out-of-window pages are -1."""
    import torch

    dev = SH["dev"]
    g = torch.Generator(device=dev).manual_seed(seed)
    totals = [c + n for c, n in zip(ctx_lens, q_lens, strict=True)]
    nblk = [-(-t // BS) for t in totals]
    num_blocks = sum(nblk) + 1
    perm = torch.randperm(num_blocks, device=dev, generator=g)
    tbl = torch.full((len(totals), max(nblk)), -1, dtype=torch.int32, device=dev)
    off = 0
    for b, n in enumerate(nblk):
        tbl[b, :n] = perm[off : off + n].to(torch.int32)
        off += n
    kc = torch.randn(num_blocks, hkv, BS, dqk, device=dev, generator=g, dtype=DT())
    vc = torch.randn(num_blocks, hkv, BS, dv, device=dev, generator=g, dtype=DT())
    q = torch.randn(sum(q_lens), hq, dqk, device=dev, generator=g, dtype=DT())
    cu = torch.tensor([0] + list(_cumsum(q_lens)), dtype=torch.int32, device=dev)
    dec = torch.tensor(ctx_lens, dtype=torch.int32, device=dev)
    table = tbl
    if headwise:
        heads = torch.arange(hkv, device=dev, dtype=torch.int32)
        table = torch.where(tbl[:, None, :] >= 0, tbl[:, None, :] * hkv + heads[None, :, None], -1)
        h0, h1 = sliding
        for b, c in enumerate(ctx_lens):
            dead = max(0, c - window) // BS  # blocks wholly before the window of the first query
            table[b, h0:h1, :dead] = -1
        table = table.reshape(len(totals) * hkv, -1).contiguous()
    return dict(q=q, kc=kc, vc=vc, cu=cu, dec=dec, table=table, headwise=headwise, totals=totals)


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


def quantize_batch(batch: dict, fmt_name: str, dequant: bool) -> dict:
    """``batch``'s caches as a quantized cache of format ``fmt_name`` (``kvcache/quant.py``): uint8 codes
    (round to nearest e4m3, or int8 ``code + 128``) and dequant scales (per token and kv head in the
    model dtype, or static per head / per channel in float32); with ``dequant`` also ``code * scale`` in
    float32 (``kc`` / ``vc`` of the returned batch: what the dense check reads). Kept on ``batch``."""
    import torch

    from fastdeploy_paddlefleet.kvcache.quant import kv_cache_quant

    done = batch.setdefault("_quant", {})
    if fmt_name in done and (not dequant or "kc" in done[fmt_name]):
        return done[fmt_name]
    fmt = kv_cache_quant(fmt_name)
    out = {"fmt": fmt}
    for which in ("k", "v"):
        x = batch[which + "c"]
        hkv, d = x.shape[1], x.shape[3]
        if fmt.dynamic:
            scale = (x.abs().amax(dim=-1).float().clamp_min(1e-6) / fmt.max_bound).to(x.dtype)
            full = scale.float()[..., None]
        else:
            amax = x.abs().amax(dim=(0, 2)).float()  # [Hkv, D]
            if not fmt.channel_wise:
                amax = amax.amax(dim=1, keepdim=True).expand(hkv, d)
            scale2 = amax.clamp_min(1e-6) / fmt.max_bound
            full = scale2[None, :, None, :]
            scale = scale2.reshape(-1).contiguous() if fmt.channel_wise else scale2[:, 0].contiguous()
        y = x.float() / full
        if fmt.code == "fp8":
            codes = y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
            deq = codes.view(torch.float8_e4m3fn).float() * full if dequant else None
        else:
            codes = (y.round().clamp(-127, 127) + 128).to(torch.uint8)
            deq = (codes.float() - 128.0) * full if dequant else None
        out[which + "codes"], out[which + "s"] = codes, scale
        if deq is not None:
            out[which + "c"] = deq
        del y
    done[fmt_name] = out
    return out


def quant_kv_bytes(kv_bytes: int, batch: dict, fmt_name: str) -> int:
    """The bytes a decode of ``kv_bytes`` (unquantized, 2-byte elements) reads from a quantized cache of
    format ``fmt_name``: one byte per element, plus the per-token scales of a dynamic format."""
    from fastdeploy_paddlefleet.kvcache.quant import kv_cache_quant

    d = batch["kc"].shape[3] + batch["vc"].shape[3]
    token_heads = kv_bytes // (d * 2)
    scales = token_heads * 2 * batch["kc"].element_size() if kv_cache_quant(fmt_name).dynamic else 0
    return kv_bytes // 2 + scales


def quant_prefill_kernel(batch: dict, fmt_name: str) -> str:
    """The prefill kernel ``auto`` runs on a ``fmt_name`` cache of ``batch``'s geometry: ``hopper`` (the
    dequantizing gather, then the Hopper kernel) on sm_90, else ``portable`` (a --src tree whose
    ``choose_prefill_impl`` takes no format: ``portable``, the only one that read quantized caches)."""
    from fastdeploy_paddlefleet.kernels.hopper_prefill import choose_prefill_impl
    from fastdeploy_paddlefleet.kvcache.quant import kv_cache_quant

    try:
        return choose_prefill_impl(None, None, batch["q"], batch["kc"], batch["vc"], kv_cache_quant(fmt_name))
    except TypeError:
        return "portable"


def _key_rows_layouts(rec: dict, batch: dict, fmt_name: str, dv: int | None) -> list:
    """The decode layouts to time a quantized cache's ``rec`` under: the plan's own (``None``), and for
    decode and mixed cases also the other one forced (``True``: key rows, ``False``: query rows;
    ``kernels/paged_attention.py`` ``decode_takes_key_rows``; a --src tree without it: the plan's own
    only)."""
    from fastdeploy_paddlefleet.kernels import paged_attention as pa_mod

    if rec.get("kind") not in ("decode", "mixed") or not hasattr(pa_mod, "decode_takes_key_rows"):
        return [None]
    dqk, dv = batch["q"].shape[2], dv or batch["vc"].shape[3]
    return [None, not pa_mod.decode_takes_key_rows(fmt_name, bool(batch["headwise"]), dqk, dv)]


def emit_quant(fh, rec: dict, batch: dict, **run_kw) -> None:
    """Time ``rec``'s case again for each of :data:`KV_QUANTS` (``run_ours`` with ``run_kw``, the caches
    quantized) and emit a record beside it: the same case, kind and work, ``impl`` ``triton-<format>``,
    bytes read (decode), ``vs_bf16`` (ms of the unquantized run over this one's); decode and mixed cases
    also under the decode layout the plan did not take (``impl`` ``triton-<format>-key-rows`` or
    ``-query-rows``)."""
    for fmt_name in KV_QUANTS:
        for layout in _key_rows_layouts(rec, batch, fmt_name, run_kw.get("dv")):
            _emit_quant_one(fh, rec, batch, fmt_name, layout, **run_kw)
    batch.pop("_quant", None)


def _emit_quant_one(fh, rec: dict, batch: dict, fmt_name: str, key_rows, **run_kw) -> None:
    """One record of :func:`emit_quant`: format ``fmt_name``, the decode layout forced to ``key_rows``
    (``True``: key rows, ``False``: query rows, ``None``: the plan's own)."""
    from fastdeploy_paddlefleet.kernels import paged_attention as pa_mod

    impl = f"triton-{fmt_name}" + {None: "", True: "-key-rows", False: "-query-rows"}[key_rows]
    kept = getattr(pa_mod, "DECODE_KEY_ROWS", None)
    if key_rows is not None:
        pa_mod.DECODE_KEY_ROWS = key_rows
    try:
        try:
            ms, errs = run_ours(rec["case"], batch, kv_quant=fmt_name, **run_kw)
        except Exception as e:  # noqa: BLE001 - keep the other formats' numbers
            emit({"case": rec["case"], "impl": impl, "kind": rec.get("kind"),
                  "kv_cache_dtype": fmt_name, "error": repr(e)[:500]}, fh)  # fmt: skip
            return
        out = {"case": rec["case"], "impl": impl, "kind": rec.get("kind"), "ms": round(ms, 4)}
        if "kv_bytes" in rec:
            nbytes = quant_kv_bytes(rec["kv_bytes"], batch, fmt_name)
            out.update(kv_bytes=nbytes, gbps=round(nbytes / (ms * 1e-3) / 1e9, 1))
        if "flops" in rec:
            out.update(flops=rec["flops"], tflops=round(rec["flops"] / (ms * 1e-3) / 1e12, 1))
        if "prefill_flops" in rec:
            out["prefill_flops"] = rec["prefill_flops"]
        out["vs_bf16"] = round(rec["ms"] / ms, 3)
        if rec.get("kind") == "prefill":
            out["kernel"] = quant_prefill_kernel(batch, fmt_name)
            if out["kernel"] == "hopper":  # what of the difference from bf16 the gather itself takes
                out.update(gather_timing(batch, fmt_name, **run_kw))
        emit({**out, **errs}, fh)
    finally:
        if key_rows is not None:
            pa_mod.DECODE_KEY_ROWS = kept


def gather_timing(
    batch: dict, fmt_name: str, *, window=None, sliding=None, max_q_len=None, max_ctx=None, **_
) -> dict:
    """The dequantizing gather alone (``kernels/kv_dequant_gather.py``) over ``batch``'s ``fmt_name``
    cache, as the prefill's plan launches it: ``gather_ms`` (:func:`bench_best`), or ``gather_error``."""
    try:
        from fastdeploy_paddlefleet.kernels.paged_attention import AttentionPlan

        qb = quantize_batch(batch, fmt_name, dequant=False)
        q = batch["q"]
        plan = AttentionPlan(
            qb["kcodes"], qb["vcodes"], q, scale=1.0, headwise=batch["headwise"], window_left=window,
            sliding_heads=sliding, kv_quant=qb["fmt"], key_scale=qb["ks"], value_scale=qb["vs"],
        )  # fmt: skip
        if plan.gather is None:
            return {"gather_error": "the plan runs no gather"}
        t = q.shape[0]

        def fn():
            plan.gather.run(
                plan.key_cache, plan.value_cache, plan.key_scale, plan.value_scale, batch["cu"], batch["dec"],
                batch["table"], t, max_q_len=max_q_len, max_context_len=max_ctx,
            )  # fmt: skip

        fn()
        return {"gather_ms": bench_best(fn)["ms"]}
    except Exception as e:  # noqa: BLE001 - the prefill's own record stands without it
        return {"gather_error": repr(e)[:300]}


def visible_keys(pos: int, window: int | None) -> int:
    return pos + 1 if window is None else min(pos + 1, window + 1)


def visible_pairs(ctx: int, n: int, window: int | None) -> int:
    return sum(visible_keys(ctx + i, window) for i in range(n))


def check_rows(batch, out, b, rows, *, scale, window, sliding, sink_kind, sinks):
    """Max abs / relative error of ``out`` rows of request ``b`` (indices within the request) vs
    the dense reference over that request's K/V gathered from the cache."""
    import torch

    from fastdeploy_paddlefleet.kernels.dense_reference import dense_attention, gather_request_kv

    total = batch["totals"][b]
    hkv = batch["kc"].shape[1]
    if batch["headwise"]:
        rows_t = batch["table"][b * hkv : (b + 1) * hkv]
    else:
        rows_t = batch["table"][b]
    k = gather_request_kv(batch["kc"], rows_t, total, headwise=batch["headwise"])
    v = gather_request_kv(batch["vc"], rows_t, total, headwise=batch["headwise"])
    start = int(batch["cu"][b])
    ctx = int(batch["dec"][b])
    idx = torch.tensor(rows, device=out.device)
    want = dense_attention(
        batch["q"][start + idx],
        k,
        v,
        scale=scale,
        q_positions=ctx + idx,
        window_left=window,
        sliding_heads=sliding,
        sink_kind=sink_kind,
        sinks=sinks,
        compute_dtype=torch.float32,
    )
    got = out[start + idx].float()
    return float((got - want).abs().max()), float((got - want).norm() / want.norm())


# ------------------------------------------------------------------------------ timing


def sync() -> None:
    import torch

    if SH["dev"] == "cuda":
        torch.cuda.synchronize()


def DT():
    import torch

    return getattr(torch, SH["dtype"])


def bench(fn) -> float:
    """Median milliseconds of ``fn`` (L2 flushed before each run)."""
    import triton

    if SH["dev"] != "cuda":  # --smoke on CPU: one timed call
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def bench_best(fn) -> dict:
    """Both timings of ``fn``: ``ms_bench`` (``bench``: one launch per timed call, so host-side
    launch cost shows when it exceeds the GPU time) and ``ms_graph`` (median of CUDA-graph replays,
    ``triton.testing.do_bench_cudagraph``: GPU time only); ``ms`` is the better of the two and
    ``timing`` says which. Graph capture failing leaves ``ms_graph`` out."""
    import triton

    out = {"ms_bench": round(bench(fn), 4)}
    if SH["dev"] == "cuda":
        try:
            out["ms_graph"] = round(
                float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")), 4
            )
        except Exception as e:  # noqa: BLE001 - a peer that cannot be captured keeps its plain timing
            out["graph_error"] = repr(e)[:120]
    best = min(out.get("ms_graph", out["ms_bench"]), out["ms_bench"])
    out["timing"] = "graph" if best != out["ms_bench"] else "do_bench"
    return {"ms": best, **out}


def copy_bandwidth(n: int = 1 << 30) -> dict:
    """Device-to-device copy of ``n`` bf16 elements: (bytes read + bytes written) / time, GB/s, under
    both timings (``gbps``: the better one; ``gbps_bench`` / ``gbps_graph``)."""
    import torch

    n = n if SH["dev"] == "cuda" else 1 << 20
    a = torch.randn(n, device=SH["dev"], dtype=DT())
    b = torch.empty_like(a)
    t = bench_best(lambda: b.copy_(a))
    rate = {
        k: round(2 * n * 2 / (t[m] * 1e-3) / 1e9, 1) for k, m in (("gbps", "ms"), ("gbps_bench", "ms_bench"))
    }
    if "ms_graph" in t:
        rate["gbps_graph"] = round(2 * n * 2 / (t["ms_graph"] * 1e-3) / 1e9, 1)
    return {**rate, "timing": t["timing"]}


# ------------------------------------------------------------------------------ our kernels


def run_ours(
    name,
    batch,
    *,
    window=None,
    sliding=None,
    sink_kind="vanilla",
    max_q_len,
    max_ctx,
    check,
    prefill_config=None,
    decode_config=None,
    num_splits=None,
    dv=None,
    prefill_impl=None,
    new_kv=None,
    kv_quant=None,
):
    """Time (and check) our kernels on ``batch``; ``kv_quant``: a quantized cache of that format
    (:func:`quantize_batch`; checked against the dense reference on the dequantized cache)."""
    import inspect

    import torch

    from fastdeploy_paddlefleet.kernels.paged_attention import paged_attention

    q = batch["q"]
    caches = (batch["kc"], batch["vc"])
    quant_kw, check_batch = {}, batch
    if kv_quant is not None:
        qb = quantize_batch(batch, kv_quant, dequant=bool(check))
        caches = (qb["kcodes"], qb["vcodes"])
        quant_kw = dict(kv_quant=qb["fmt"], key_scale=qb["ks"], value_scale=qb["vs"])
        if prefill_impl == "hopper":
            # auto: on sm_90 the Hopper prefill through the dequantizing gather (kernels/kv_dequant_gather.py;
            # a --src tree from before it: the portable prefill)
            prefill_impl = None
        if check:
            check_batch = {**batch, "kc": qb["kc"], "vc": qb["vc"]}
    flag_kw, check_kernel_errors = {}, None
    if "errors" in inspect.signature(paged_attention).parameters:  # (--src: an older tree has no flag)
        from fastdeploy_paddlefleet.kernels.errors import check_kernel_errors, new_error_flag

        flag_kw = {"errors": new_error_flag(q)}  # as served: bad table entries recorded in a flag
    hq, dqk = q.shape[1], q.shape[2]
    dv = dv or batch["vc"].shape[3]
    scale = 1.0 / math.sqrt(dqk)
    sinks = torch.randn(hq, device=SH["dev"]) * 2 if sink_kind == "learnable" else None
    out = torch.full((q.shape[0], hq, dv), float("nan"), device=SH["dev"], dtype=q.dtype)

    def fn():
        return paged_attention(
            q,
            caches[0],
            caches[1],
            batch["cu"],
            batch["dec"],
            batch["table"],
            scale=scale,
            headwise=batch["headwise"],
            window_left=window,
            sliding_heads=sliding,
            sink_kind=sink_kind,
            sinks=sinks,
            max_q_len=max_q_len,
            max_context_len=max_ctx,
            out=out,
            num_splits=num_splits,
            prefill_config=prefill_config,
            decode_config=decode_config,
            prefill_impl=prefill_impl,
            **flag_kw,
            **quant_kw,
            **({} if new_kv is None else {"new_kv": new_kv}),
        )

    fn()
    sync()
    if flag_kw:
        check_kernel_errors(flag_kw["errors"])  # valid tables: the flag stays clear
    errs = {}
    if check:
        assert torch.isfinite(out).all(), f"{name}: unwritten or non-finite output"
        worst = (0.0, 0.0)
        for b, rows in check:
            e = check_rows(
                check_batch,
                out,
                b,
                rows,
                scale=scale,
                window=window,
                sliding=sliding,
                sink_kind=sink_kind,
                sinks=sinks,
            )
            worst = (max(worst[0], e[0]), max(worst[1], e[1]))
        errs = {"max_abs_err": float(f"{worst[0]:.3g}"), "rel_err": float(f"{worst[1]:.3g}")}
    t = bench_best(fn)
    kv_dtype = {"kv_cache_dtype": kv_quant or str(batch["kc"].dtype).rsplit(".", 1)[-1]}
    return t["ms"], {**errs, **{k: v for k, v in t.items() if k != "ms"}, **kv_dtype}


# ------------------------------------------------------------------------------ peers


def flex_fn(with_sinks: bool, fused: bool = True):
    """Compiled FlexAttention (GQA). With sinks the output is scaled by ``sigmoid(lse - sink)`` (lse in
    natural log): inside the compiled graph (``fused``) or as eager torch ops after it."""
    import torch
    from torch.nn.attention import flex_attention as fa

    aux = getattr(fa, "AuxRequest", None)

    def attend(q, k, v, block_mask):
        if not with_sinks:
            return fa.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True), None
        if aux is not None:
            out, a = fa.flex_attention(
                q, k, v, block_mask=block_mask, enable_gqa=True, return_aux=aux(lse=True)
            )
            return out, a.lse
        return fa.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True)

    def correct(out, lse, sinks):
        if not with_sinks:
            return out
        return out * torch.sigmoid(lse - sinks[None, :, None]).unsqueeze(-1).to(out.dtype)

    if fused:
        return torch.compile(lambda q, k, v, bm, s: correct(*attend(q, k, v, bm), s), dynamic=False)
    compiled = torch.compile(attend, dynamic=False)
    return lambda q, k, v, bm, s: correct(*compiled(q, k, v, bm), s)


def peer_sdpa(q, k, v, backend, causal):
    """torch SDPA on contiguous ``[B, H, S, D]``; GQA native if the backend takes it, else K/V expanded."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    rep = q.shape[1] // k.shape[1]
    with sdpa_kernel([be]):
        try:
            sdpa(q, k, v, is_causal=causal, enable_gqa=True)
            args, kw = (q, k, v), dict(is_causal=causal, enable_gqa=True)
            how = "gqa"
        except RuntimeError:
            ke, ve = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            sdpa(q, ke, ve, is_causal=causal)
            args, kw = (q, ke, ve), dict(is_causal=causal)
            how = "expanded kv"

        def fn():
            with sdpa_kernel([be]):
                return sdpa(*args, **kw)

        t = bench_best(fn)
        return t["ms"], how, t


def peer_records(kind, case, q, k, v, *, causal, window, sinks, work, unit, fh, flex=True, tag=""):
    """Time SDPA (causal or no mask; only without window and sinks) and FlexAttention on contiguous
    tensors; emit one record each (impl name + ``tag``)."""

    q_len, kv_len = q.shape[2], k.shape[2]
    sdpa_ok = window is None and sinks is None
    for backend in ("cudnn", "flash") if sdpa_ok else ():
        try:
            ms, how, t = peer_sdpa(q, k, v, backend, causal)
            emit(
                {
                    "case": case,
                    "impl": f"sdpa-{backend}{tag}",
                    "kind": kind,
                    "ms": round(ms, 4),
                    "note": how,
                    unit: round(work / (ms * 1e-3) / 1e9 / (1e3 if unit == "tflops" else 1), 1),
                    **{k: x for k, x in t.items() if k != "ms"},
                },
                fh,
            )
        except Exception as e:  # noqa: BLE001 - a peer that cannot run is recorded, not fatal
            emit({"case": case, "impl": f"sdpa-{backend}{tag}", "kind": kind, "error": repr(e)[:200]}, fh)
    if not (flex and FLEX):
        return
    from torch.nn.attention.flex_attention import create_block_mask

    off = kv_len - q_len

    def mask(b, h, qi, ki):
        keep = ki <= qi + off
        if window is not None:
            keep = keep & (qi + off - ki <= window)
        return keep

    # with sinks: the correction compiled into the graph, and (as a user might write it) eager
    for fused in (True, False) if sinks is not None else (True,):
        impl = "flex" + tag + ("" if fused else "-eager-sinks")
        try:
            flex = flex_fn(sinks is not None, fused)
            bm = create_block_mask(mask, None, None, q_len, kv_len, device=SH["dev"])
            fn = lambda: flex(q, k, v, bm, sinks)  # noqa: B023 - called inside this iteration
            for _ in range(3):  # compile, then settle (autotuning, recompiles) before any timing
                fn()
            sync()
            t = bench_best(fn)
            ms = t.pop("ms")
            rate = work / (ms * 1e-3) / 1e9 / (1e3 if unit == "tflops" else 1)
            emit(
                {"case": case, "impl": impl, "kind": kind, "ms": round(ms, 4), unit: round(rate, 1), **t}, fh
            )
        except Exception as e:  # noqa: BLE001
            emit({"case": case, "impl": impl, "kind": kind, "error": repr(e)[:300]}, fh)


# ------------------------------------------------------------------------------ cases


def step_kv(batch):
    """This step's K/V of a decode batch (per-request block tables) as ``new_kv`` takes them
    (``[T, Hkv, D]``): the values the cache already holds at each request's position, so a fused
    write stores them again unchanged and the dense check still holds."""
    import torch

    if batch["headwise"]:
        raise ValueError("step_kv reads per-request block tables, not head-wise page tables")
    dec = batch["dec"].long()
    blocks = batch["table"][torch.arange(dec.shape[0], device=dec.device), dec // BS].long()
    return batch["kc"][blocks, :, dec % BS].contiguous(), batch["vc"][blocks, :, dec % BS].contiguous()


def decode_cases(fh, check, peers):
    import torch

    bsz, ctx, win = SH["bsz"], SH["ctx"], SH["window"]
    variants = [
        ("decode-full", None, None, "vanilla", False),
        ("decode-swa1024", win, None, "vanilla", False),
        ("decode-swa1024-sinks", win, None, "learnable", False),
        ("decode-headwise", win, (4, 8), "vanilla", True),
    ]
    for name, window, sliding, sink_kind, headwise in variants:
        batch = paged_batch(
            [ctx - 1] * bsz,
            [1] * bsz,
            HQ,
            HKV,
            D,
            D,
            window=window,
            sliding=sliding,
            headwise=headwise,
            seed=1,
        )
        if window is None:
            keys = bsz * HKV * ctx
        else:
            h0, h1 = sliding or (0, HKV)
            keys = bsz * ((HKV - (h1 - h0)) * ctx + (h1 - h0) * visible_keys(ctx - 1, window))
        nbytes = keys * (D + D) * 2
        run_kw = dict(
            window=window,
            sliding=sliding,
            sink_kind=sink_kind,
            max_q_len=1,
            max_ctx=ctx,
            check=[(0, [0]), (bsz - 1, [0])] if check else None,
        )
        ms, errs = run_ours(name, batch, **run_kw)
        rec = {
            "case": name,
            "impl": "triton",
            "kind": "decode",
            "ms": round(ms, 4),
            "kv_bytes": nbytes,
            "gbps": round(nbytes / (ms * 1e-3) / 1e9, 1),
            **errs,
        }
        emit(rec, fh)
        emit_quant(fh, rec, batch, **run_kw)
        if name == "decode-full":  # the served decode: the step's K/V written by the same launch
            try:
                rows = [(0, [0]), (bsz - 1, [0])] if check else None
                ms, errs = run_ours(name, batch, max_q_len=1, max_ctx=ctx, check=rows, new_kv=step_kv(batch))
                rec = {
                    "ms": round(ms, 4),
                    "kv_bytes": nbytes,
                    "gbps": round(nbytes / (ms * 1e-3) / 1e9, 1),
                    **errs,
                }
            except TypeError as e:  # an older tree (--src): no fused write
                rec = {"error": repr(e)[:200]}
            emit({"case": name, "impl": "triton-fused-write", "kind": "decode", **rec}, fh)
        del batch
        if peers and name in ("decode-full", "decode-swa1024-sinks"):
            span = ctx if window is None else window + 1  # contiguous KV: only the keys needed
            q = torch.randn(bsz, HQ, 1, D, device=SH["dev"], dtype=DT())
            k = torch.randn(bsz, HKV, span, D, device=SH["dev"], dtype=DT())
            v = torch.randn_like(k)
            sinks = torch.randn(HQ, device=SH["dev"]) if sink_kind == "learnable" else None
            common = dict(causal=False, window=None, work=nbytes, unit="gbps", fh=fh)
            # SDPA has no sinks: for the sinks case it runs without them (an upper bound), tagged
            peer_records("decode", name, q, k, v, sinks=None, flex=False,
                         tag="" if sinks is None else "-nosinks", **common)  # fmt: skip
            if sinks is not None:
                peer_records("decode", name, q, k, v, sinks=sinks, **common)
            del q, k, v


def prefill_cases(fh, check, peers, *, hq=HQ, hkv=HKV, dqk=D, dv=D, prefix="prefill", names=None):
    import torch

    n, win = SH["n"], SH["window"]
    variants = [
        (f"{prefix}-causal", None, "vanilla"),
        (f"{prefix}-swa1024", win, "vanilla"),
        (f"{prefix}-swa1024-sinks", win, "learnable"),
    ]
    for name, window, sink_kind in variants:
        if names is not None and name not in names:
            continue
        batch = paged_batch([0], [n], hq, hkv, dqk, dv, seed=2)
        flops = 2 * visible_pairs(0, n, window) * (dqk + dv) * hq
        rows = sorted({0, 1, win - 1, win, win + 1, n // 2 + 1, n - 1})
        from fastdeploy_paddlefleet.kernels.hopper_prefill import choose_prefill_impl

        default = choose_prefill_impl(None, None, batch["q"], batch["kc"], batch["vc"])
        # "triton": what the backend runs by default; on sm_90 also the portable kernel, for comparison
        for impl, kernel in (("triton", default), ("triton-portable", "portable")):
            if impl != "triton" and kernel == default:
                continue
            run_kw = dict(
                window=window,
                sink_kind=sink_kind,
                max_q_len=n,
                max_ctx=n,
                check=[(0, rows)] if check else None,
            )
            ms, errs = run_ours(name, batch, prefill_impl=kernel, **run_kw)
            rec = {
                "case": name,
                "impl": impl,
                "kind": "prefill",
                "kernel": kernel,
                "ms": round(ms, 4),
                "flops": flops,
                "tflops": round(flops / (ms * 1e-3) / 1e12, 1),
                **errs,
            }
            emit(rec, fh)
            if impl == "triton":  # quantized (auto: the Hopper prefill through the gather on sm_90)
                emit_quant(fh, rec, batch, **run_kw)
        del batch
        if peers:
            q = torch.randn(1, hq, n, dqk, device=SH["dev"], dtype=DT())
            k = torch.randn(1, hkv, n, dqk, device=SH["dev"], dtype=DT())
            v = torch.randn(1, hkv, n, dv, device=SH["dev"], dtype=DT())
            sinks = torch.randn(hq, device=SH["dev"]) if sink_kind == "learnable" else None
            peer_records(
                "prefill",
                name,
                q,
                k,
                v,
                causal=True,
                window=window,
                sinks=sinks,
                work=flops,
                unit="tflops",
                fh=fh,
            )
            del q, k, v


def mixed_case(fh, check):
    nd, ctx, npf = SH["mixed"]
    batch = paged_batch([ctx - 1] * nd + [0], [1] * nd + [npf], HQ, HKV, D, D, seed=3)
    nbytes = nd * HKV * ctx * 2 * D * 2
    flops = 2 * visible_pairs(0, npf, None) * 2 * D * HQ
    run_kw = dict(
        max_q_len=npf, max_ctx=ctx, check=[(0, [0]), (nd, [0, npf // 3, npf - 1])] if check else None
    )
    ms, errs = run_ours("mixed", batch, **run_kw)
    rec = {
        "case": "mixed",
        "impl": "triton",
        "kind": "mixed",
        "ms": round(ms, 4),
        "decode_kv_bytes": nbytes,
        "prefill_flops": flops,
        **errs,
    }
    emit(rec, fh)
    emit_quant(fh, rec, batch, **run_kw)
    del batch
    for part, (ctxs, qs) in {"decode": ([ctx - 1] * nd, [1] * nd), "prefill": ([0], [npf])}.items():
        batch = paged_batch(ctxs, qs, HQ, HKV, D, D, seed=4)
        ms_p, _ = run_ours("mixed-" + part, batch, max_q_len=max(qs), max_ctx=ctx, check=None)
        rec = {"case": "mixed", "impl": "triton-" + part + "-alone", "kind": "mixed", "ms": round(ms_p, 4)}
        if part == "decode":
            rec["gbps"] = round(nbytes / (ms_p * 1e-3) / 1e9, 1)
        else:
            rec["tflops"] = round(flops / (ms_p * 1e-3) / 1e12, 1)
        emit(rec, fh)
        del batch


def gptoss_case(fh, check):
    """gpt-oss's sliding layers: 64 q / 8 kv heads, head 64, a 128-key window (``window_left`` 127) with
    learnable sinks, one 8192-token prefill; the default kernel and, on sm_90, the portable one (short
    windows give the Hopper kernel's work items only 2-3 key tiles each: its per-item cost dominates)."""
    from fastdeploy_paddlefleet.kernels.hopper_prefill import choose_prefill_impl

    n, hq, hkv, d = SH["n"], 64, 8, 64
    window = min(127, SH["window"])
    batch = paged_batch([0], [n], hq, hkv, d, d, seed=4)
    flops = 2 * visible_pairs(0, n, window) * 2 * d * hq
    default = choose_prefill_impl(None, None, batch["q"], batch["kc"], batch["vc"])
    for impl, kernel in (("triton", default), ("triton-portable", "portable")):
        if impl != "triton" and kernel == default:
            continue
        rows = [0, window, n // 2, n - 1]
        ms, errs = run_ours("gptoss-prefill-swa128-sinks", batch, window=window, sink_kind="learnable",
                            max_q_len=n, max_ctx=n, check=[(0, rows)] if check else None,
                            prefill_impl=kernel)  # fmt: skip
        rec = {
            "case": "gptoss-prefill-swa128-sinks",
            "impl": impl,
            "kind": "prefill",
            "kernel": kernel,
            "ms": round(ms, 4),
            "flops": flops,
            "tflops": round(flops / (ms * 1e-3) / 1e12, 1),
            **errs,
        }
        emit(rec, fh)
        if impl == "triton":
            emit_quant(fh, rec, batch, window=window, sink_kind="learnable", max_q_len=n, max_ctx=n,
                       check=[(0, rows)] if check else None)  # fmt: skip
    del batch


def mla_cases(fh, check, peers):
    import torch

    h, dqk, dv, bsz, ctx = 16, 192, 128, SH["bsz"], SH["ctx"]
    batch = paged_batch([ctx - 1] * bsz, [1] * bsz, h, h, dqk, dv, seed=5)
    nbytes = bsz * h * ctx * (dqk + dv) * 2
    run_kw = dict(max_q_len=1, max_ctx=ctx, check=[(0, [0])] if check else None)
    ms, errs = run_ours("mla-decode", batch, **run_kw)
    rec = {
        "case": "mla-decode",
        "impl": "triton",
        "kind": "decode",
        "ms": round(ms, 4),
        "kv_bytes": nbytes,
        "gbps": round(nbytes / (ms * 1e-3) / 1e9, 1),
        **errs,
    }
    emit(rec, fh)
    emit_quant(fh, rec, batch, **run_kw)
    del batch
    if peers:
        q = torch.randn(bsz, h, 1, dqk, device=SH["dev"], dtype=DT())
        k = torch.randn(bsz, h, ctx, dqk, device=SH["dev"], dtype=DT())
        v = torch.randn(bsz, h, ctx, dv, device=SH["dev"], dtype=DT())
        peer_records(
            "decode",
            "mla-decode",
            q,
            k,
            v,
            causal=False,
            window=None,
            sinks=None,
            work=nbytes,
            unit="gbps",
            fh=fh,
        )
        del q, k, v
    prefill_cases(
        fh, check, peers, hq=h, hkv=h, dqk=dqk, dv=dv, prefix="mla-prefill", names={"mla-prefill-causal"}
    )


#: decode variants over a quantized cache: (block_n, warps, stages, splits, maxnreg, e4m3 code mode, key rows:
#: kernels/paged_attention.py DECODE_KEY_ROWS); the first of each case's list is the key-rows layout's default
#: tile, the last the query-rows default (the query-rows variants of earlier sweeps:
#: results/attention-h100-sweep-fp8-2026-12-07e.jsonl)
FP8_DECODE_VARIANTS = {
    "decode-full": [
        (64, 4, 3, 1, 128, 3, True),
        (64, 4, 3, 1, None, 3, True),
        (64, 4, 2, 1, None, 3, True),
        (64, 4, 4, 1, None, 3, True),
        (64, 4, 3, 2, None, 3, True),
        (32, 2, 3, 1, None, 3, True),
        (32, 2, 4, 1, None, 3, True),
        (16, 1, 4, 1, None, 3, True),
        (16, 1, 4, 4, None, 3, True),
        (32, 1, 3, 4, None, 3, True),
        (32, 2, 3, 2, None, 3, True),
        (128, 8, 3, 1, None, 3, True),
        (128, 8, 3, 1, 128, 3, True),
        (64, 4, 3, 1, 128, 3, False),
    ],
    "decode-swa1024-sinks": [
        (32, 2, 3, 1, 128, 3, True),
        (32, 2, 3, 1, None, 3, True),
        (64, 4, 3, 1, 128, 3, True),
        (64, 2, 3, 1, None, 3, True),
        (32, 2, 4, 1, None, 3, True),
        (16, 1, 4, 1, None, 3, True),
        (64, 4, 3, 2, None, 3, True),
        (32, 2, 3, 1, None, 1, False),
    ],
}


def fp8_decode_sweep(fh, name: str, batch: dict, fmt_name: str, nbytes: int, **run_kw) -> None:
    """Decode tile / split / register-cap / code-mode variants of case ``name`` over a ``fmt_name`` cache
    (``--sweep --kv-cache-quant FMT``); ``kv_bytes``: the quantized bytes read."""
    from fastdeploy_paddlefleet.kernels import paged_attention as pa_mod
    from fastdeploy_paddlefleet.kernels.paged_attention import TileConfig

    bsz, ctx = SH["bsz"], SH["ctx"]
    qbytes = quant_kv_bytes(nbytes, batch, fmt_name)
    kept = pa_mod.FP8_F16_CODES_DECODE, getattr(pa_mod, "DECODE_KEY_ROWS", None)
    try:
        for bn, w, s, splits, cap, codes, key_rows in FP8_DECODE_VARIANTS.get(name, []):
            row = {"sweep": name, "kv_cache_dtype": fmt_name, "block_n": bn, "warps": w, "stages": s}
            row.update(splits=splits, maxnreg=cap, f16_codes=codes, key_rows=key_rows)
            pa_mod.FP8_F16_CODES_DECODE = codes
            pa_mod.DECODE_KEY_ROWS = key_rows
            try:
                ms, errs = run_ours(
                    name, batch, max_q_len=1, max_ctx=ctx, check=[(bsz - 1, [0])], kv_quant=fmt_name,
                    decode_config=TileConfig(16, bn, w, s, False, maxnreg=cap), num_splits=splits, **run_kw,
                )  # fmt: skip
                gbps = round(qbytes / (ms * 1e-3) / 1e9, 1)
                emit({**row, "ms": round(ms, 4), "kv_bytes": qbytes, "gbps": gbps, **errs}, fh)
            except Exception as e:  # noqa: BLE001 - keep the other variants' numbers
                emit({**row, "error": repr(e)[:300]}, fh)
    finally:
        pa_mod.FP8_F16_CODES_DECODE, pa_mod.DECODE_KEY_ROWS = kept
        batch.pop("_quant", None)


def sweep(fh, cases: set[str]):
    """Tile / split / TMA variants of the headline cases (tuning; see NOTES.md): decode's where ``cases``
    holds ``decode`` (with :func:`fp8_decode_sweep` for each ``--kv-cache-quant`` format), prefill's where
    it holds ``prefill``."""
    from fastdeploy_paddlefleet.kernels.paged_attention import TileConfig

    bsz, ctx, win = SH["bsz"], SH["ctx"], SH["window"]
    dec_variants = [  # (block_n, warps, stages, tma, splits)
        (64, 4, 3, False, 1), (64, 4, 4, False, 1), (32, 4, 4, False, 1),
    ]  # fmt: skip
    dec_cases = (("decode-full", None, "vanilla"), ("decode-swa1024-sinks", win, "learnable"))
    for name, window, sink_kind in dec_cases if "decode" in cases else ():
        batch = paged_batch([ctx - 1] * bsz, [1] * bsz, HQ, HKV, D, D, seed=6)
        keys = bsz * HKV * visible_keys(ctx - 1, window)
        nbytes = keys * 2 * D * 2
        for bn, w, s, tma, splits in dec_variants:
            cfg = TileConfig(16, bn, w, s, tma)
            row = {"sweep": name, "block_n": bn, "warps": w, "stages": s, "tma": tma, "splits": splits}
            try:
                ms, errs = run_ours(
                    name,
                    batch,
                    window=window,
                    sink_kind=sink_kind,
                    max_q_len=1,
                    max_ctx=ctx,
                    check=[(bsz - 1, [0])],
                    decode_config=cfg,
                    num_splits=splits,
                )
                emit({**row, "ms": round(ms, 4), "gbps": round(nbytes / (ms * 1e-3) / 1e9, 1), **errs}, fh)
            except Exception as e:  # noqa: BLE001
                emit({**row, "error": repr(e)[:300]}, fh)
        for fmt_name in KV_QUANTS:
            fp8_decode_sweep(fh, name, batch, fmt_name, nbytes, window=window, sink_kind=sink_kind)
        del batch
    pre_variants = [  # (block_m, block_n, warps, stages, tma, exp_bf16, profile)
        (128, 64, 8, 3, False, False, 0), (128, 64, 8, 3, False, True, 0), (64, 64, 4, 3, False, False, 0),
        (64, 64, 4, 3, False, True, 0), (128, 64, 8, 4, False, True, 0), (128, 64, 8, 3, False, False, 1),
        (128, 64, 8, 3, False, False, 2), (64, 64, 4, 3, False, False, 1), (64, 64, 4, 3, False, False, 2),
    ]  # fmt: skip
    n, win = SH["n"], SH["window"]
    pre_cases = (("prefill-causal", None, "vanilla"), ("prefill-swa1024-sinks", win, "learnable"))
    for name, window, sink_kind in pre_cases if "prefill" in cases else ():
        batch = paged_batch([0], [n], HQ, HKV, D, D, seed=7)
        flops = 2 * visible_pairs(0, n, window) * 2 * D * HQ
        for bm, bn, w, s, tma, fast, prof in pre_variants:
            if prof and window is not None:
                continue  # the ablations once, on the causal case
            cfg = TileConfig(bm, bn, w, s, tma, fast, prof)
            row = {"sweep": name, "block_m": bm, "block_n": bn, "warps": w, "stages": s, "tma": tma}
            row.update(exp_bf16=fast, profile=prof)
            try:
                ms, errs = run_ours(
                    name,
                    batch,
                    window=window,
                    sink_kind=sink_kind,
                    max_q_len=n,
                    max_ctx=n,
                    check=None if prof else [(0, [5, n // 2, n - 1])],
                    prefill_config=cfg,
                )
                tflops = round(flops / (ms * 1e-3) / 1e12, 1)
                emit({**row, "ms": round(ms, 4), "tflops": tflops, **errs}, fh)
            except Exception as e:  # noqa: BLE001
                emit({**row, "error": repr(e)[:300]}, fh)
        del batch


# ------------------------------------------------------------------------------ host cost per launch


def _host_us(fn, calls: int, repeats: int = 5) -> dict:
    """Host time of one eager call of ``fn``: ``calls`` calls back to back, synced once after the loop
    (the GPU, given tiny kernels, keeps up), median and min over ``repeats`` loops, microseconds.
    ``cpu_us``: the process's CPU time per call in the median loop."""
    fn()
    sync()
    walls, cpus = [], []
    for _ in range(repeats):
        sync()
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(calls):
            fn()
        t1, c1 = time.perf_counter(), time.process_time()
        sync()
        walls.append((t1 - t0) / calls * 1e6)
        cpus.append((c1 - c0) / calls * 1e6)
    order = sorted(range(repeats), key=lambda i: walls[i])
    mid = order[repeats // 2]
    rec = {"us": round(walls[mid], 2), "us_min": round(min(walls), 2), "cpu_us": round(cpus[mid], 2)}
    if SH["dev"] == "cuda":
        rec.update(_host_us_queued(fn, repeats))
    return rec


QUEUED_CALLS = 150  # calls per queued loop: ~300-450 launches, under the launch queue's depth


def _host_us_queued(fn, repeats: int) -> dict:
    """``us_queued`` / ``us_queued_min``: the same calls issued behind a kernel that keeps the GPU busy
    (``torch.cuda._sleep``) for longer than the loop takes, :data:`QUEUED_CALLS` at a time: no launch
    waits for the GPU or for room in the launch queue, so the loop's wall time is the host's alone. (The
    back-to-back loop's figure becomes the GPU's time per call when the kernels take longer than the
    host; e.g. the Hopper prefill's persistent grid at tiny shapes.)"""
    import torch

    walls = []
    for _ in range(repeats):
        sync()
        torch.cuda._sleep(200_000_000)  # ~0.1 s at the H200's clocks: longer than any loop below
        t0 = time.perf_counter()
        for _ in range(QUEUED_CALLS):
            fn()
        walls.append((time.perf_counter() - t0) / QUEUED_CALLS * 1e6)
        sync()
    walls.sort()
    return {"us_queued": round(walls[repeats // 2], 2), "us_queued_min": round(walls[0], 2)}


@functools.lru_cache(maxsize=1)
def trivial_kernels() -> tuple:
    """Two Triton kernels that do nothing worth timing, with 20 and 40 runtime arguments (a pointer
    ``X``, then ints; ``N`` constexpr): the yardsticks of a launch's host cost (also
    ``probes/launch_parts.py``)."""
    import triton
    import triton.language as tl

    @triton.jit
    def trivial20(
        X, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, N: tl.constexpr
    ):
        o = tl.arange(0, N)
        tl.store(X + o, tl.load(X + o) + a1)

    @triton.jit
    def trivial40(
        X, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20,
        b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12, b13, b14, b15, b16, b17, b18, N: tl.constexpr,
    ):  # fmt: skip
        o = tl.arange(0, N)
        tl.store(X + o, tl.load(X + o) + a1)

    return trivial20, trivial40


HOST_HQ, HOST_HKV, HOST_D, HOST_BSZ = 4, 2, 64, 4  # the host cases' tiny shapes


def host_batches() -> dict:
    """The host cases' inputs: ``dec`` (4 requests decoding one token over 15 cached), ``pre`` (two
    16-token chunks, one over 16 cached tokens), this step's ``k`` and ``bid`` for the cache write, and
    ``flag_kw`` (an error flag where the tree has one)."""
    import inspect

    import torch

    from fastdeploy_paddlefleet.kernels import paged_attention as pa

    dev, hq, hkv, d, bsz = SH["dev"], HOST_HQ, HOST_HKV, HOST_D, HOST_BSZ
    dec_b = paged_batch([15] * bsz, [1] * bsz, hq, hkv, d, d, seed=8)
    pre_b = paged_batch([0, 16], [16, 16], hq, hkv, d, d, seed=9)
    flag_kw = {}
    if "errors" in inspect.signature(pa.paged_attention).parameters:
        from fastdeploy_paddlefleet.kernels.errors import new_error_flag

        flag_kw = {"errors": new_error_flag(dec_b["q"])}
    k = torch.randn(dec_b["q"].shape[0], hkv, d, device=dev, dtype=DT())
    bid = torch.arange(bsz, dtype=torch.int32, device=dev)
    return {"dec": dec_b, "pre": pre_b, "k": k, "bid": bid, "flag_kw": flag_kw}


def one_shot_cases(b: dict | None = None) -> list:
    """``(name, call)`` of each one-shot wrapper on :func:`host_batches`' inputs (``b``, else new ones):
    ``write_kv_cache``, ``paged_attention`` decode, portable and default (``auto``) prefill, ``out``
    and the error flag given (also ``probes/launch_parts.py --wrappers``)."""
    import torch

    from fastdeploy_paddlefleet.kernels import cache_write as cw
    from fastdeploy_paddlefleet.kernels import paged_attention as pa

    b = b or host_batches()
    dec_b, pre_b, k, bid, flag_kw = b["dec"], b["pre"], b["k"], b["bid"], b["flag_kw"]

    def attn(batch, max_q, impl=None):
        out = torch.empty(batch["q"].shape[0], HOST_HQ, HOST_D, device=SH["dev"], dtype=DT())
        args = (batch["q"], batch["kc"], batch["vc"], batch["cu"], batch["dec"], batch["table"])
        kw = dict(scale=0.125, max_q_len=max_q, max_context_len=32, out=out, prefill_impl=impl, **flag_kw)
        return lambda: pa.paged_attention(*args, **kw)

    def write():
        cw.write_kv_cache(
            k, k, dec_b["kc"], dec_b["vc"], bid, dec_b["cu"], dec_b["dec"], dec_b["table"], **flag_kw
        )

    return [
        ("write_kv_cache", write),
        ("paged_attention-decode", attn(dec_b, 1)),
        ("paged_attention-prefill-portable", attn(pre_b, 16, "portable")),
        ("paged_attention-prefill-auto", attn(pre_b, 16)),
    ]


def host_cost_cases(fh, calls: int = 2000) -> None:
    """Host (CPU) time per eager launch of each kernel wrapper at tiny shapes (the GPU idles between
    calls), beside what bounds it: a trivial Triton kernel with 20 / 40 arguments through Triton's
    launcher, the same kernel's compiled launcher called directly (the pointer as a tensor, and as an
    address), our own launcher on it (``kernels/launch/own_launcher.py``), and a torch elementwise op."""
    import torch

    calls = calls if SH["dev"] == "cuda" else 3
    dev = SH["dev"]
    hq, hkv, d = HOST_HQ, HOST_HKV, HOST_D
    b = host_batches()
    dec_b, pre_b, k, bid = b["dec"], b["pre"], b["k"], b["bid"]

    x = torch.zeros(1024, device=dev)
    trivial20, trivial40 = trivial_kernels()
    ints20 = [3] * 18
    ints40 = [3] * 38
    cases = [
        ("torch-add_", lambda: x.add_(1)),
        ("triton-20-args", lambda: trivial20[(1,)](x, *ints20, N=16)),
        ("triton-40-args", lambda: trivial40[(1,)](x, *ints40, N=16)),
    ]
    if dev == "cuda":
        from triton.runtime import driver

        k40 = trivial40[(1,)](x, *ints40, N=16)
        all40 = (x, *ints40, 16)

        def direct40():
            stream = driver.active.get_current_stream(driver.active.get_current_device())
            k40.run(1, 1, 1, stream, k40.function, k40.packed_metadata, None, None, None, *all40)

        cases.append(("triton-40-args-direct", direct40))
        addr40 = (x.data_ptr(), *ints40, 16)

        def direct40_addr():  # as the plans call it: pointers as addresses
            stream = driver.active.get_current_stream(driver.active.get_current_device())
            k40.run(1, 1, 1, stream, k40.function, k40.packed_metadata, None, None, None, *addr40)

        cases.append(("triton-40-args-direct-addr", direct40_addr))
        try:  # our launcher (kernels/launch/own_launcher.py) on the same compiled kernel; older trees: none
            own40 = launch_module("own_launcher").own_launcher(k40, len(addr40) - 1, (16,))
        except ImportError:
            own40 = None
        if own40 is not None:
            lead40 = addr40[:-1]

            def own40_call():
                stream = driver.active.get_current_stream(driver.active.get_current_device())
                own40((1,), lead40, stream)

            cases.append(("own-launcher-40-args", own40_call))
    cases += one_shot_cases(b)
    try:
        from fastdeploy_paddlefleet.backends.base import BatchMeta
        from fastdeploy_paddlefleet.backends.triton import TritonBackend

        try:
            from fastdeploy_paddlefleet.plan.layer import LayerAttention
        except ImportError:
            from fastdeploy_paddlefleet.spec.layer import LayerAttention
        layer = LayerAttention(
            index=0, kind="full", num_q_heads=hq, num_kv_heads=hkv, qk_head_dim=d, v_head_dim=d,
            softmax_scale=0.125,
        )  # fmt: skip
        lens = dec_b["cu"][1:] - dec_b["cu"][:-1]
        meta = BatchMeta(
            seq_lens_encoder=torch.zeros_like(lens), seq_lens_decoder=dec_b["dec"], seq_lens_this_time=lens,
            cu_seqlens_q=dec_b["cu"], batch_id_per_token=bid, block_tables=dec_b["table"], block_size=BS,
            max_seq_len_this_time=1, max_context_len=32,
        )  # fmt: skip
        served = TritonBackend(validate=False, host_checks=False)
        kv = (dec_b["kc"], dec_b["vc"])
        cases.append(("backend-layer-served", lambda: served.forward(dec_b["q"], k, k, layer, meta, kv)))
        cases.append(("backend-layer-served-fused", lambda: fused.forward(dec_b["q"], k, k, layer, meta, kv)))
        # the cache write fused into the decode launch (FDFLEET_FUSED_DECODE_WRITE, read when a plan is
        # built): one launch per decode layer
        fused = TritonBackend(validate=False, host_checks=False)
        old_env = os.environ.get("FDFLEET_FUSED_DECODE_WRITE")
        os.environ["FDFLEET_FUSED_DECODE_WRITE"] = "1"
        try:
            fused.forward(dec_b["q"], k, k, layer, meta, (dec_b["kc"], dec_b["vc"]))  # builds its plan
        finally:
            if old_env is None:
                del os.environ["FDFLEET_FUSED_DECODE_WRITE"]
            else:
                os.environ["FDFLEET_FUSED_DECODE_WRITE"] = old_env
        # FastDeploy's setting: shapes checked (validate), no host copy of the metadata
        checked = TritonBackend(validate=True, host_checks=False)
        cases.append(
            ("backend-layer-served-checked", lambda: checked.forward(dec_b["q"], k, k, layer, meta, kv))
        )
        # a prefill step (two 16-token chunks, one over 16 cached tokens): the Hopper kernel on sm_90
        pre_lens = pre_b["cu"][1:] - pre_b["cu"][:-1]
        pre_t = pre_b["q"].shape[0]
        pre_k = torch.randn(pre_t, hkv, d, device=dev, dtype=DT())
        pre_meta = BatchMeta(
            seq_lens_encoder=pre_lens, seq_lens_decoder=pre_b["dec"], seq_lens_this_time=pre_lens,
            cu_seqlens_q=pre_b["cu"], batch_id_per_token=torch.repeat_interleave(
                torch.arange(2, dtype=torch.int32, device=dev), pre_lens.long()),
            block_tables=pre_b["table"], block_size=BS, max_seq_len_this_time=16, max_context_len=32,
        )  # fmt: skip
        pre_kv = (pre_b["kc"], pre_b["vc"])
        cases.append(
            (
                "backend-layer-served-prefill",
                lambda: served.forward(pre_b["q"], pre_k, pre_k, layer, pre_meta, pre_kv),
            )
        )
    except Exception as e:  # noqa: BLE001 - an older tree: the kernels' figures still count
        emit({"case": "host-backend-layer-served", "impl": "triton", "error": repr(e)[:200]}, fh)
    _launch = launch_module("direct")
    direct = getattr(_launch, "direct_wanted", lambda: bool(_launch.DIRECT_LAUNCH))()  # older trees: the flag
    launch_kw = {"direct_launch": direct, "address_args": getattr(_launch, "ADDRESS_ARGS", False)}
    if hasattr(_launch, "own_wanted"):  # FDFLEET_OWN_LAUNCHER=off: the A/B against Triton's compiled launcher
        launch_kw["own_launcher"] = direct and _launch.own_wanted()
    for name, fn in cases:
        try:
            rec = _host_us(fn, calls)
        except Exception as e:  # noqa: BLE001
            emit({"case": "host-" + name, "impl": "triton", "kind": "host", "error": repr(e)[:300]}, fh)
            continue
        emit(
            {"case": "host-" + name, "impl": "triton", "kind": "host", "calls": calls, **rec, **launch_kw}, fh
        )


# ------------------------------------------------------------------------------ summary and plot


def summary(records: list[dict]) -> list[dict]:
    """Targets of issues 4, 14 and 20 from the records: figure, peer figure, ratio, pass/fail."""
    by = {(r.get("case"), r.get("impl")): r for r in records if "case" in r and "error" not in r}
    copy = next((r["gbps"] for r in records if r.get("case") == "copy"), None)
    out = []

    def add(target, ours, peer, need):
        if ours is None or peer is None:
            out.append({"target": target, "missing": True})
            return
        if not (math.isfinite(ours) and math.isfinite(peer) and peer > 0):
            # a zero or non-finite figure (a time below the timer's resolution at --smoke shapes, a
            # failed peer): no ratio to compare, said so, instead of a ZeroDivisionError that used to
            # end the run before the plot and leave only the records
            out.append({"target": target, "ours": ours, "peer": peer, "missing": True, "no_ratio": True})
            return
        ratio = ours / peer
        out.append(
            {
                "target": target,
                "ours": ours,
                "peer": peer,
                "ratio": round(ratio, 3),
                "need": need,
                "met": ratio >= need,
            }
        )

    def get(case, impl, key):
        r = by.get((case, impl))
        return r.get(key) if r else None

    same_size = next((r["gbps"] for r in records if r.get("case") == "copy-268MB"), None)
    # (target, ours: case and metric, the peer: an implementation of the same case or a number, need)
    targets = [
        # issue 20 (MLA prefill on the Hopper path; prefill at cuDNN speed)
        ("prefill causal >= 1.0 x sdpa-cudnn (same run)", "prefill-causal", "tflops", "sdpa-cudnn", 1.0),
        ("MLA prefill causal (qk 192 / v 128) >= 0.9 x sdpa-cudnn (same run)", "mla-prefill-causal", "tflops",
         "sdpa-cudnn", 0.9),
        # issue 14 (the Hopper prefill path; window decode)
        ("prefill causal >= 0.95 x sdpa-cudnn (same run)", "prefill-causal", "tflops", "sdpa-cudnn", 0.95),
        ("decode swa1024+sinks >= 0.9 x same-size copy (268 MB)", "decode-swa1024-sinks", "gbps", same_size,
         0.9),
        ("prefill swa1024+sinks >= 400 TFLOP/s", "prefill-swa1024-sinks", "tflops", 400.0, 1.0),
        # issue 4
        ("decode full >= 0.9 x copy", "decode-full", "gbps", copy, 0.9),
        ("decode swa1024+sinks >= 0.9 x copy", "decode-swa1024-sinks", "gbps", copy, 0.9),
        ("prefill causal >= 1.3 x flex", "prefill-causal", "tflops", "flex", 1.3),
        ("prefill causal >= 0.75 x sdpa-cudnn", "prefill-causal", "tflops", "sdpa-cudnn", 0.75),
        ("prefill swa1024+sinks >= 2 x flex(sinks)", "prefill-swa1024-sinks", "tflops", "flex", 2.0),
        ("prefill swa1024+sinks >= 2 x flex(sinks corrected eagerly)", "prefill-swa1024-sinks", "tflops",
         "flex-eager-sinks", 2.0),
    ]  # fmt: skip
    for target, case, metric, peer, need in targets:
        peer_figure = get(case, peer, metric) if isinstance(peer, str) else peer
        add(target, get(case, "triton", metric), peer_figure, need)
    return out


def ratios(records: list[dict]) -> list[dict]:
    """Per case: ours (``triton``) over every other implementation measured in the same run
    (``ours / peer`` in the case's unit; > 1 means ours is faster). Quantized-cache runs carry their own
    ``vs_bf16`` and stay out."""
    rows = [
        r
        for r in records
        if "impl" in r and "error" not in r and r.get("kind") != "copy" and "vs_bf16" not in r
    ]
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        group = [r for r in rows if r["case"] == case]
        ours = next((r for r in group if r["impl"] == "triton"), None)
        key = "gbps" if ours and "gbps" in ours else "tflops"
        if ours is None or key not in ours:
            continue
        rec = {"ratios": True, "case": case, "unit": key, "triton": ours[key]}
        for r in group:
            if r is not ours and r.get(key):
                rec[f"vs_{r['impl']}"] = round(ours[key] / r[key], 3)
        out.append(rec)
    return out


def plot(records: list[dict], path: str) -> bool:
    """Two panels (decode GB/s, prefill TFLOP/s): per case, one labelled bar per implementation."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in records if "impl" in r and "error" not in r and r.get("kind") != "copy"]
    copy = next((r["gbps"] for r in records if r.get("case") == "copy"), None)
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    colors = {impl: plt.get_cmap("tab10")(i % 10) for i, impl in enumerate(impls)}
    fig, axes = plt.subplots(2, 1, figsize=(14, 10))
    for ax, key, title in (
        (axes[0], "gbps", "decode: effective GB/s"),
        (axes[1], "tflops", "prefill: TFLOP/s"),
    ):
        sel = [r for r in rows if key in r]
        x, ticks, labels, seen = 0.0, [], [], set()
        for case in dict.fromkeys(r["case"] for r in sel):
            group = [r for r in sel if r["case"] == case]
            ours = next((r[key] for r in group if r["impl"] == "triton"), None)
            for i, r in enumerate(group):
                label = None if r["impl"] in seen else r["impl"]
                seen.add(r["impl"])
                ax.bar(x + i, r[key], 0.9, color=colors[r["impl"]], label=label)
                text = f"{r[key]:.0f}"
                if ours and r["impl"] != "triton":  # the ratio column: ours / this peer
                    text += f"\n{ours / r[key]:.2f}x"
                ax.text(x + i, r[key], text, ha="center", va="bottom", fontsize=6)
            ticks.append(x + (len(group) - 1) / 2)
            labels.append(case)
            x += len(group) + 1
        ax.set_xticks(ticks)
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_title(title + "  (labels: value, and ours / that implementation)")
        if key == "gbps" and copy:
            ax.axhline(copy, color="k", ls="--", lw=1, label=f"copy {copy:.0f}")
            ax.axhline(0.9 * copy, color="r", ls=":", lw=1, label="90% of copy")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    meta = next((r for r in records if r.get("meta")), {})
    fig.suptitle(
        f"paged attention, {meta.get('device', '?')}, bf16, block 64, triton {meta.get('triton', '?')}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def print_comparison(records: list[dict], then: list[dict]) -> None:
    """Each (case, impl) of ``records`` beside the same one in ``then`` (the records of ``--compare``):
    the case's figure (GB/s, TFLOP/s or ms), both timings where recorded, and the ratio now / then."""
    old = {(r.get("case"), r.get("impl")): r for r in then if "case" in r and "error" not in r}
    head = f"{'case':28} {'impl':22} {'metric':7} {'now':>9} {'then':>9} {'ratio':>6}"
    print(head + "  ms now/then (bench | graph)")
    for r in records:
        key = (r.get("case"), r.get("impl"))
        if "case" not in r or "error" in r or key not in old:
            continue
        o = old[key]
        metric = next((m for m in ("gbps", "tflops", "ms", "us") if m in r and m in o), None)
        if metric is None:
            continue
        ratio = r[metric] / o[metric] if o[metric] else float("nan")
        times = " | ".join(f"{r.get(k, '-')}/{o.get(k, '-')}" for k in ("ms_bench", "ms_graph"))
        print(f"{key[0]:28} {key[1]:22} {metric:7} {r[metric]:9} {o[metric]:9} {ratio:6.3f}  {times}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Needs a CUDA GPU with torch and triton (pip install -e '.[bench]'); --smoke also runs on a "
        "CPU, under Triton's interpreter (it sets TRITON_INTERPRET=1 itself). Without them it exits 2 "
        "naming what is missing.",
    )
    ap.add_argument(
        "--out",
        default=None,
        help="JSON lines file (default: a new temporary directory; the committed results "
        f"{DEFAULT_OUT} only when named, never by --smoke)",
    )
    ap.add_argument(
        "--compare",
        metavar="FILE",
        default=None,
        help="print each case's figure beside the same case in FILE (e.g. the committed results)",
    )
    ap.add_argument("--plot", default=None, help="plot path, .png/.svg/.pdf (default: --out with .png)")
    ap.add_argument("--plot-only", metavar="FILE", help="draw the PNG from saved JSON lines and exit")
    ap.add_argument("--force", action="store_true", help=force_help("the --out and --plot files"))
    ap.add_argument(
        "--cases",
        default="copy,decode,prefill,mixed,mla,gptoss,host",
        help="comma list (default: %(default)s); with --sweep, decode and / or prefill",
    )
    ap.add_argument("--no-peers", action="store_true", help="skip SDPA / FlexAttention")
    ap.add_argument("--no-flex", action="store_true", help="peers: SDPA only (FlexAttention compiles slowly)")
    ap.add_argument("--no-check", action="store_true", help="skip the dense-reference checks")
    ap.add_argument("--sweep", action="store_true", help="time tile / split / TMA variants instead")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter without a GPU)")
    ap.add_argument(
        "--kv-cache-quant",
        default="none",
        help=f"comma list of {', '.join(KV_QUANT_CHOICES)}: also time each of our decode / prefill / mixed / "
        "MLA / gpt-oss cases on a quantized KV cache of these formats (records impl triton-<format>, with "
        "kv_cache_dtype and vs_bf16); default %(default)s",
    )
    ap.add_argument(
        "--err-scan",
        action="store_true",
        help="portable kernels find bad table entries by one scan after the key loop (not in the loop)",
    )
    ap.add_argument(
        "--fp8-decode-codes",
        type=int,
        choices=(1, 2, 3),
        default=None,
        help="how decode reads e4m3 codes under a bf16 model (kernels/paged_attention.py "
        "FP8_F16_CODES_DECODE; default: the module's, None: chosen per plan by fp8_decode_setup)",
    )
    ap.add_argument(
        "--fp8-decode-maxnreg",
        type=int,
        default=None,
        help="register cap on the default decode tiles of an fp8 cache, 24..255 (kernels/paged_attention.py "
        "FP8_DECODE_MAXNREG; default: the module's)",
    )
    ap.add_argument(
        "--decode-key-rows",
        choices=("auto", "on", "off"),
        default=None,
        help="decode's key tiles as the dots' rows (kernels/paged_attention.py DECODE_KEY_ROWS; on / off: "
        "every cache; auto: where key_rows_by_default and FDFLEET_DECODE_KEY_ROWS say so; default: the "
        "module's)",
    )
    launch = ap.add_mutually_exclusive_group()
    launch.add_argument(
        "--direct-launch",
        dest="direct_launch",
        action="store_true",
        default=None,
        help="launch compiled kernels directly (kernels/launch/direct.py DIRECT_LAUNCH; default: "
        "FDFLEET_DIRECT_LAUNCH, on unless set off)",
    )
    launch.add_argument(
        "--no-direct-launch",
        dest="direct_launch",
        action="store_false",
        help="every launch through Triton's own launch path (A/B against direct launches)",
    )
    ap.add_argument(
        "--tensor-args",
        action="store_true",
        help="direct launches pass tensors, not addresses (kernels/launch/direct.py ADDRESS_ARGS; "
        "an A/B of the launcher's per-pointer cost)",
    )
    ap.add_argument(
        "--src",
        default=None,
        help="import fastdeploy_paddlefleet from this source tree instead (A/B against an older commit)",
    )
    args = ap.parse_args(argv)
    quants = [x.strip() for x in args.kv_cache_quant.split(",") if x.strip()]
    bad = [x for x in quants if x not in KV_QUANT_CHOICES]
    if bad:
        ap.error(f"--kv-cache-quant {args.kv_cache_quant!r}: {bad} not among {', '.join(KV_QUANT_CHOICES)}")
    KV_QUANTS[:] = [x for x in quants if x != "none"]
    if args.fp8_decode_maxnreg is not None and not 24 <= args.fp8_decode_maxnreg <= 255:
        ap.error(f"--fp8-decode-maxnreg {args.fp8_decode_maxnreg}: not in 24..255")
    then = None
    try:  # where this run writes, and what it reads: refused by name before any work (_outputs.py)
        if args.plot_only:
            out = Path(args.plot_only)
            recs = read_jsonl(out, "--plot-only")
            if not any("impl" in r and "case" in r for r in recs):
                raise Refused(f"--plot-only {str(out)!r} holds no benchmark record (none with case and impl)")
            png = plot_path(args.plot, out, smoke=False)
            png_claim = claim(png, script=SCRIPT, force=args.force, flag="--plot", beside=out)
        else:
            out = output_path(args.out, name="attention.jsonl", suffixes=(".jsonl",), what="JSON lines",
                              smoke=args.smoke)  # fmt: skip
            png = plot_path(args.plot, out, smoke=args.smoke)
            out_claim = claim(out, script=SCRIPT, force=args.force)
            png_claim = claim(png, script=SCRIPT, force=args.force, flag="--plot", beside=out)
            if args.compare:
                then = read_jsonl(args.compare, "--compare")
    except ValueError as e:
        return fail(e)
    if args.plot_only:
        try:
            drawn = write_plot(recs, png_claim)
        except Refused as e:
            return fail(e)
        except (KeyError, TypeError, ValueError) as e:  # records of another shape than this script's
            return fail(Refused(f"--plot-only {str(out)!r}: a record is not what this script writes ({e!r})"))
        if not drawn:
            print("matplotlib is not installed", file=sys.stderr)
            return 1
        print(png)
        return 0

    if args.src:
        sys.path.insert(0, os.path.abspath(args.src))
    problem = device_problem("benchmarks/attention.py") if not args.smoke else None
    if problem:
        return fail(problem + " (--smoke runs tiny shapes on a CPU)")
    import torch

    if args.smoke:
        SH.update(SMOKE)
        if torch.cuda.is_available():
            SH.update(dev="cuda", dtype="bfloat16")
        else:  # before the kernels are imported: @triton.jit reads it at decoration time
            os.environ["TRITON_INTERPRET"] = "1"
    import triton

    if args.direct_launch is not None or args.tensor_args:  # an older tree (--src): the same attributes
        _launch = launch_module("direct")
        if args.direct_launch is not None:
            _launch.DIRECT_LAUNCH = args.direct_launch
        if args.tensor_args:
            _launch.ADDRESS_ARGS = False
    from fastdeploy_paddlefleet.kernels import paged_attention as pa_mod

    if args.err_scan:
        pa_mod.ERR_LOOP_PREFILL = pa_mod.ERR_LOOP_DECODE = False
    if args.fp8_decode_codes is not None:
        pa_mod.FP8_F16_CODES_DECODE = args.fp8_decode_codes
    if args.fp8_decode_maxnreg is not None:
        pa_mod.FP8_DECODE_MAXNREG = args.fp8_decode_maxnreg
    if args.decode_key_rows is not None:
        pa_mod.DECODE_KEY_ROWS = {"auto": None, "on": True, "off": False}[args.decode_key_rows]
    t0 = time.time()
    # the previous file stays until the run completes (and only if it is this script's, or --force)
    with replacing(out_claim) as tmp, open(tmp, "w", encoding="utf-8") as f:
        fh = RecordFile(f, SCRIPT)
        on_gpu = SH["dev"] == "cuda"
        props = torch.cuda.get_device_properties(0) if on_gpu else None
        emit(
            {
                "meta": True,
                "device": props.name if on_gpu else "cpu (interpreter)",
                "sms": props.multi_processor_count if on_gpu else 0,
                "torch": torch.__version__,
                "triton": triton.__version__,
                "dtype": SH["dtype"],
                "block_size": BS,
                "stat": "median of do_bench",
                "mode": "sweep" if args.sweep else "cases",
                "fp8_decode_codes": getattr(pa_mod, "FP8_F16_CODES_DECODE", None),
                "fp8_decode_maxnreg": getattr(pa_mod, "FP8_DECODE_MAXNREG", None),
                "decode_key_rows": getattr(pa_mod, "DECODE_KEY_ROWS", None),
            },
            fh,
        )
        cases = set(args.cases.split(","))
        check, peers = not args.no_check, not args.no_peers
        global FLEX
        FLEX = not args.no_flex
        if "copy" in cases:
            emit({"case": "copy", "impl": "copy", "kind": "copy", **copy_bandwidth()}, fh)
            # the same bytes as the sliding-window decode (268 MB moved): what a small transfer reaches
            small = {
                "case": "copy-268MB",
                "impl": "copy",
                "kind": "copy",
                **copy_bandwidth(1 << 26),
            }
            emit(small, fh)
        if args.sweep:
            sweep(fh, cases)
        else:
            steps = (
                ("decode", lambda: decode_cases(fh, check, peers)),
                ("prefill", lambda: prefill_cases(fh, check, peers)),
                ("mixed", lambda: mixed_case(fh, check)),
                ("mla", lambda: mla_cases(fh, check, peers)),
                ("gptoss", lambda: gptoss_case(fh, check)),
                ("host", lambda: host_cost_cases(fh)),
            )
            for name, step in steps:
                if name in cases:
                    try:
                        step()
                    except Exception as e:  # noqa: BLE001 - keep the other cases' numbers
                        emit({"case": name, "impl": "triton", "error": repr(e)[:500]}, fh)
                    if on_gpu:
                        torch.cuda.empty_cache()
            for r in ratios(RECORDS):
                emit(r, fh)
            for s in summary(RECORDS):
                emit({"summary": True, **s}, fh)
        emit({"meta": True, "wall_s": round(time.time() - t0, 1)}, fh)
    if then is not None:
        print_comparison(RECORDS, then)
    print(out, file=sys.stderr)
    try:
        if not args.sweep and write_plot(RECORDS, png_claim):
            print(png, file=sys.stderr)
    except Refused as e:
        return fail(e)
    return 0


def write_plot(records: list[dict], png: Claim) -> bool:
    """Draw ``records`` into ``png`` (a :func:`claim`) all or nothing; ``False`` (``png`` untouched)
    without matplotlib."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    with replacing(png) as tmp:
        if not plot(records, str(tmp)):
            raise RuntimeError(f"could not draw {png.path}")
    return True


if __name__ == "__main__":
    sys.exit(main())
