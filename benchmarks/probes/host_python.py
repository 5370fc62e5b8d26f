"""The Python around each launch (issue 20): host time per call of every kernel wrapper, launches stubbed.

On the H200's host one launch through our launcher costs ~5 us; what a wrapper costs beyond that is
Python (memo key, step metadata, argument tuples, output allocation). This script times that Python
alone, on any machine, on the path a GPU takes: the *direct* path, where a plan asks its
:class:`~fastdeploy_paddlefleet.kernels.launch.direct.KernelCache` for the kept kernel and calls it with
addresses (not Triton's ``fn[grid](...)`` path, which is what runs on a CPU).

How, without hooks in the package: plans are built with :class:`StubKernels`, a ``KernelCache`` whose
``direct`` is on and whose kept kernel for every key is a no-op (installed as the ``KernelCache`` the
plan modules build theirs from; Triton's path raises, so a case that leaves the direct path fails).
On a CPU every tensor reads ``is_cuda`` True while the cases run (:func:`gpu_like_tensors`), so the
step and plan checks that gate direct launches pass as on a GPU; on a GPU they are real CUDA tensors.

Cases (the shapes of ``attention.py --cases host``: 4 q / 2 kv heads of 64, block 64; fp32 on a CPU,
bf16 on a GPU): ``write_kv_cache`` one-shot (4 decode tokens); ``paged_attention`` decode one-shot
(4 requests x 1 token, context 16, ``out`` and an error flag given); portable prefill one-shot (two
16-token chunks, one over 16 cached tokens); ``TritonBackend.forward`` for one layer of a decode step
(``validate=False, host_checks=False``), the same with FastDeploy's settings (``validate=True,
host_checks=False``) and one layer of the prefill step (same step object every call: the per-layer
cost alone); ``backend-step-served`` / ``-checked``: a whole decode step of 8 layers (each its own
caches) on a new ``BatchMeta`` per step, us per layer (the per-step derivations, e.g. the full shape
check FastDeploy's settings run on a step's first layer, spread over its layers). Yardsticks on the
same machine: torch ``add_`` on a
16-element tensor, ``torch.empty`` and ``Tensor.new_empty`` of a decode output.

Prints one JSON line per case (``{"kind": "host-python", "case", "us", "us_min", "calls", "device",
"direct_launches"}``: median and min over ``--repeats`` loops of ``--calls`` calls, microseconds;
``direct_launches``: kept kernels called per call, checked before timing).

Usage::

    python benchmarks/probes/host_python.py [--out FILE.jsonl] [--calls N] [--repeats R] [--device cpu|cuda]
                                     [--cases a,b] [--tag KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))  # benchmarks/probes/
BENCH = os.path.dirname(HERE)  # benchmarks/: _outputs.py
SRC = os.path.join(os.path.dirname(BENCH), "src")
for _dir in (SRC, BENCH):  # also when loaded by file path (the tests)
    if _dir not in sys.path:
        sys.path.insert(0, _dir)
from _outputs import choose, fail, force_help, open_records, parse_tags  # noqa: E402

HQ, HKV, D, BS = 4, 2, 64, 64
CASES = (
    "torch-add_",
    "torch-empty",
    "new_empty",
    "write_kv_cache",
    "paged_attention-decode",
    "paged_attention-prefill-portable",
    "backend-layer-served",
    "backend-layer-served-checked",
    "backend-layer-served-prefill",
    "backend-step-served",
    "backend-step-served-checked",
    "backend-layer-paddle-views",
    "backend-layer-paddle-lane",
    "backend-step-paddle-views",
    "backend-step-paddle-lane",
)
STEP_LAYERS = 8  # layers per step of the backend-step cases


def _noop(grid, args, stream) -> None:
    """A kept kernel that launches nothing."""


class _Counter:
    """A kept kernel that counts its calls and checks that it is given addresses, not tensors."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, grid, args, stream) -> None:
        bad = [type(a).__name__ for a in args if hasattr(a, "data_ptr")]
        if bad:
            raise TypeError(f"a kept kernel was given tensors ({bad}), not addresses")
        self.calls += 1


def stub_kernels():
    """The :class:`StubKernels` class (torch and the package imported on first use)."""
    from fastdeploy_paddlefleet.kernels.launch.direct import KernelCache

    class StubKernels(KernelCache):
        """A plan's kernel cache as on a GPU with every kernel compiled and kept: ``direct`` on,
        addresses, and for every key a kept kernel (:attr:`hit`, a no-op while timing). Triton's path
        (``launch``) raises: a wrapper that leaves the direct path is not what a GPU runs."""

        hit = staticmethod(_noop)

        def __init__(self, device_index=None) -> None:
            super().__init__(None)
            self.direct, self.addresses, self.own = True, True, False

        def stream(self) -> int:
            return 0

        def kernel(self, key):
            return None if key is None else StubKernels.hit

        def launch(self, fn, key, grid, args, consts, stream) -> None:
            raise RuntimeError(f"took Triton's launch path (key {key!r}): not the direct path")

    return StubKernels


@contextlib.contextmanager
def gpu_like_tensors(on: bool):
    """While active (``on``), every torch tensor says it is on a GPU: ``torch.Tensor.is_cuda`` reads
    True (an attribute of torch's Python ``Tensor`` class, removed on exit), so the checks that gate a
    direct launch (``LaunchStep.direct_ok``, the plans' ``is_cuda`` reads) pass as they do on a GPU, and
    every tensor keeps its plain type (a ``Tensor`` subclass costs ~0.2 us more per attribute read)."""
    import torch

    if not on:
        yield
        return
    if "is_cuda" in torch.Tensor.__dict__:
        raise RuntimeError("torch.Tensor.is_cuda is already overridden")
    torch.Tensor.is_cuda = property(lambda self: True)
    paddle = _paddle()
    if paddle is not None:  # paddle's is_cuda is a property of its Tensor class: swapped, then restored
        from fastdeploy_paddlefleet.kernels import _framework as fw

        paddle_is_cuda, reader = paddle.Tensor.__dict__["is_cuda"], fw.paddle_stream_reader
        paddle.Tensor.is_cuda = property(lambda self: True)
        fw.paddle_stream_reader = lambda index: lambda: 0  # a CPU build has no CUDA stream to read
    try:
        yield
    finally:
        del torch.Tensor.is_cuda
        if paddle is not None:
            paddle.Tensor.is_cuda, fw.paddle_stream_reader = paddle_is_cuda, reader


def _paddle():
    """paddle, or ``None`` where it is not installed."""
    try:
        import paddle
    except ImportError:
        return None
    return paddle


def build_cases(device: str) -> dict:
    """Every case's callable, on ``device`` (``cpu``: GPU-like CPU tensors), plans stubbed."""
    import torch

    from fastdeploy_paddlefleet.backends.base import BatchMeta
    from fastdeploy_paddlefleet.backends.triton import TritonBackend
    from fastdeploy_paddlefleet.kernels import cache_write as cw
    from fastdeploy_paddlefleet.kernels import paged_attention as pa
    from fastdeploy_paddlefleet.kernels.errors import new_error_flag
    from fastdeploy_paddlefleet.kernels.launch.direct import PlanMemo
    from fastdeploy_paddlefleet.plan.layer import LayerAttention

    stub = stub_kernels()
    # the plan modules build their kernel caches from these names: every plan built from now on is stubbed
    pa.KernelCache = cw.KernelCache = stub
    pa._PLANS, cw._PLANS = PlanMemo(), PlanMemo()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)

    def dev(x):
        return x.to(device)

    def batch(ctx, qlen):
        """A paged batch: caches, shuffled blocks, q / k / v and the int32 metadata."""
        nblk = [-(-(c + n) // BS) for c, n in zip(ctx, qlen, strict=True)]
        num_blocks = sum(nblk) + 2
        perm = iter(torch.randperm(num_blocks, generator=gen).tolist())
        table = torch.full((len(ctx), max(nblk) + 1), -1, dtype=torch.int32)
        for b, n in enumerate(nblk):
            for j in range(n):
                table[b, j] = next(perm)
        t = sum(qlen)
        lens = torch.tensor(qlen, dtype=torch.int32)
        cu = torch.zeros(len(ctx) + 1, dtype=torch.int32)
        cu[1:] = lens.cumsum(0)
        b = dict(
            kc=torch.randn(num_blocks, HKV, BS, D, generator=gen),
            vc=torch.randn(num_blocks, HKV, BS, D, generator=gen),
            q=torch.randn(t, HQ, D, generator=gen),
            k=torch.randn(t, HKV, D, generator=gen),
            v=torch.randn(t, HKV, D, generator=gen),
            out=torch.empty(t, HQ, D),
            cu=cu,
            dec=torch.tensor(ctx, dtype=torch.int32),
            lens=lens,
            bid=torch.repeat_interleave(torch.arange(len(ctx), dtype=torch.int32), lens.long()),
            table=table,
        )
        b = {n: dev(x.to(dtype) if x.is_floating_point() else x) for n, x in b.items()}
        b["meta"] = BatchMeta(
            seq_lens_encoder=dev(torch.where(b["dec"] == 0, b["lens"], 0)), seq_lens_decoder=b["dec"],
            seq_lens_this_time=b["lens"], cu_seqlens_q=b["cu"], batch_id_per_token=b["bid"],
            block_tables=b["table"], block_size=BS, max_seq_len_this_time=max(qlen),
            max_context_len=max(c + n for c, n in zip(ctx, qlen, strict=True)),
        )  # fmt: skip
        return b

    dec_b = batch([15] * 4, [1] * 4)
    pre_b = batch([0, 16], [16, 16])
    flag = new_error_flag(dec_b["q"])
    layer = LayerAttention(
        index=0, kind="full", num_q_heads=HQ, num_kv_heads=HKV, qk_head_dim=D, v_head_dim=D,
        softmax_scale=0.125,
    )  # fmt: skip

    served = TritonBackend(validate=False, host_checks=False)
    checked = TritonBackend(validate=True, host_checks=False)  # FastDeploy's settings: no host copy
    add_x = torch.zeros(16, device=device)
    empty_shape = (dec_b["q"].shape[0], HQ, D)
    d, p = dec_b, pre_b
    kv, pkv = (d["kc"], d["vc"]), (p["kc"], p["vc"])
    # a whole decode step as a model runs it: a new BatchMeta (the same metadata tensors), then
    # STEP_LAYERS layers, each with its own caches: the per-step derivations (step state, the table's
    # LaunchStep, FastDeploy's settings: the step's first full shape check) spread over the layers
    layers = [
        LayerAttention(
            index=i,
            kind="full",
            num_q_heads=HQ,
            num_kv_heads=HKV,
            qk_head_dim=D,
            v_head_dim=D,
            softmax_scale=0.125,
        )  # fmt: skip
        for i in range(STEP_LAYERS)
    ]
    layer_kv = [(d["kc"].clone(), d["vc"].clone()) for _ in layers]
    meta_fields = {f.name: getattr(d["meta"], f.name) for f in dataclasses.fields(BatchMeta)}

    def step(backend, t=d, fields=meta_fields, caches=layer_kv):
        """A whole step: a new BatchMeta of ``fields``, then every layer on ``t``'s q / k / v."""

        def run():
            meta = BatchMeta(**fields)
            for lyr, c in zip(layers, caches, strict=True):
                backend.forward(t["q"], t["k"], t["v"], lyr, meta, c)

        return run

    cases = {}
    paddle = _paddle()
    if paddle is not None and device == "cpu":  # FastDeploy's tensors beside torch (the paddle lane)

        class ViewsOnly(TritonBackend):
            """The backend as before the lane: paddle tensors always cross by DLPack views."""

            def _run_kept(self, *args):
                return None

        def to_paddle(x):
            return paddle.to_tensor(x.numpy()) if isinstance(x, torch.Tensor) else x

        pd = {n: to_paddle(d[n]) for n in ("q", "k", "v", "kc", "vc")}
        p_fields = {n: to_paddle(x) for n, x in meta_fields.items()}
        pmeta = BatchMeta(**p_fields)
        pkv_ = (pd["kc"], pd["vc"])
        views = ViewsOnly(validate=False, host_checks=False)
        lane = TritonBackend(validate=False, host_checks=False)
        cases["backend-layer-paddle-views"] = lambda: views.forward(
            pd["q"], pd["k"], pd["v"], layer, pmeta, pkv_
        )
        cases["backend-layer-paddle-lane"] = lambda: lane.forward(
            pd["q"], pd["k"], pd["v"], layer, pmeta, pkv_
        )
        p_caches = [(to_paddle(kc), to_paddle(vc)) for kc, vc in layer_kv]
        cases["backend-step-paddle-views"] = step(views, pd, p_fields, p_caches)
        cases["backend-step-paddle-lane"] = step(lane, pd, p_fields, p_caches)
    return cases | {
        "torch-add_": lambda: add_x.add_(1),
        "torch-empty": lambda: torch.empty(empty_shape, dtype=dtype, device=device),
        "new_empty": lambda: d["q"].new_empty(empty_shape),
        "write_kv_cache": lambda: cw.write_kv_cache(
            d["k"], d["v"], *kv, d["bid"], d["cu"], d["dec"], d["table"], errors=flag
        ),
        "paged_attention-decode": lambda: pa.paged_attention(
            d["q"],
            *kv,
            d["cu"],
            d["dec"],
            d["table"],
            scale=0.125,
            max_q_len=1,
            max_context_len=32,
            out=d["out"],
            errors=flag,
        ),  # fmt: skip
        "paged_attention-prefill-portable": lambda: pa.paged_attention(
            p["q"],
            *pkv,
            p["cu"],
            p["dec"],
            p["table"],
            scale=0.125,
            max_q_len=16,
            max_context_len=32,
            out=p["out"],
            errors=flag,
            prefill_impl="portable",
        ),  # fmt: skip
        "backend-layer-served": lambda: served.forward(d["q"], d["k"], d["v"], layer, d["meta"], kv),
        "backend-layer-served-checked": lambda: checked.forward(d["q"], d["k"], d["v"], layer, d["meta"], kv),
        "backend-layer-served-prefill": lambda: served.forward(p["q"], p["k"], p["v"], layer, p["meta"], pkv),
        "backend-step-served": step(served),
        "backend-step-served-checked": step(checked),
    }


def direct_launches(fn, stub) -> int:
    """Kept kernels one call of ``fn`` calls (after a warm-up call), every one given addresses."""
    fn()
    counter = _Counter()
    stub.hit = counter
    try:
        fn()
    finally:
        stub.hit = staticmethod(_noop)
    return counter.calls


def lanes(fn) -> dict:
    """How often one call of ``fn`` took each plan's kept lane (``launch_kept`` returning True), was
    refused there (a kernel it needs not kept under the lane's key) and took the step path
    (``_launch_step``: also where the lane's gate failed): the plans' methods wrapped for that call."""
    from fastdeploy_paddlefleet.kernels import cache_write as cw
    from fastdeploy_paddlefleet.kernels import paged_attention as pa

    seen = {"kept": 0, "kept-refused": 0, "step": 0}
    saved = []
    for cls in (pa.AttentionPlan, cw.CacheWritePlan):
        kept, step = cls.launch_kept, cls._launch_step

        def kept_counted(self, *a, _f=kept, **k):
            ok = _f(self, *a, **k)
            seen["kept" if ok else "kept-refused"] += 1
            return ok

        def step_counted(self, *a, _f=step, **k):
            seen["step"] += 1
            return _f(self, *a, **k)

        saved.append((cls, kept, step))
        cls.launch_kept, cls._launch_step = kept_counted, step_counted
    try:
        fn()
    finally:
        for cls, kept, step in saved:
            cls.launch_kept, cls._launch_step = kept, step
    return seen


def per_call_us(fn, calls: int, repeats: int) -> tuple[float, float]:
    """Median and min over ``repeats`` loops of ``calls`` calls of ``fn``, microseconds per call."""
    fn()
    res = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        res.append((time.perf_counter() - t0) / calls * 1e6)
    res.sort()
    return res[len(res) // 2], res[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="also append the JSON lines to this .jsonl file")
    ap.add_argument("--force", action="store_true", help=force_help("the --out file"))
    ap.add_argument("--calls", type=int, default=20000, help="calls per timed loop (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=5, help="timed loops per case (default: %(default)s)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    ap.add_argument("--cases", default=",".join(CASES), help="comma list (default: all)")
    ap.add_argument("--tag", action="append", default=[], help="KEY=VALUE added to every record")
    a = ap.parse_args(argv)
    if a.calls < 1 or a.repeats < 1:
        ap.error("--calls and --repeats must be >= 1")
    if a.out is not None and not a.out.endswith(".jsonl"):
        ap.error(f"--out {a.out!r} must name a .jsonl file")
    try:
        names = choose(a.cases, CASES, "--cases")
        tags = parse_tags(a.tag)
    except ValueError as e:
        ap.error(str(e))
    try:
        fh = open_records(a.out, script="host_python", force=a.force)  # refused before any work
    except ValueError as e:
        return fail(e)
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":  # the backend serves CPU tensors only under the interpreter (its own check)
        os.environ["TRITON_INTERPRET"] = "1"
    cases = build_cases(device)
    from fastdeploy_paddlefleet.kernels import paged_attention as pa

    stub = pa.KernelCache
    failed = 0
    try:
        with gpu_like_tensors(device == "cpu"):
            for name in names:
                rec = {"kind": "host-python", "case": name, "device": device, **tags}
                fn = cases.get(name)
                if fn is None:  # a paddle case without paddle (or on a GPU: no paddle there)
                    rec["skipped"] = "needs paddle on the CPU"
                    print(json.dumps(rec), flush=True)
                    if fh is not None:
                        fh.record(rec)
                    continue
                try:
                    if not name.startswith(("torch-", "new_")):
                        rec["direct_launches"] = direct_launches(fn, stub)
                        rec["lanes"] = lanes(fn)
                    per = STEP_LAYERS if name.startswith("backend-step") else 1  # us per layer
                    calls = max(1, a.calls // per)
                    med, best = per_call_us(fn, calls, a.repeats)
                    rec.update(us=round(med / per, 2), us_min=round(best / per, 2), calls=calls)
                    if per > 1:
                        rec["layers"] = per
                except Exception as e:  # noqa: BLE001 - one case's failure is its record
                    rec["error"] = repr(e)[:300]
                    failed += 1
                print(json.dumps(rec), flush=True)
                if fh is not None:
                    fh.record(rec)
    finally:
        if fh is not None:
            fh.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
