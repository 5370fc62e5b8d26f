"""What the Hopper prefill's safe launch costs when no flag is set, alone and beside the fast launch.

The prefill runs twice a step (``kernels/hopper_prefill.py``, "Masked keys"): the fast launch, then the
safe launch, whose CTAs exit at once unless the fast launch found a non-finite output row. For each case
(8192 tokens of one request, 32 q heads / 8 kv heads, 128 / 128, bf16, sinks; causal, window 1023, window
127), this probe times the fast launch alone, the safe launch alone and the two in turn, ten turns per
CUDA-graph replay (``decode_probe``'s graph timing). It then replays sequences of kernels under
``torch.profiler`` and reports each kernel's own duration (median, us): the fast launch back to back,
after the safe launch, after a safe launch of one CTA, after an empty Triton kernel, in turn with another
binary of the same work (``fast_err``: the error-flag variant, whose producer also records bad table
entries), after an idle launch of its own binary (``fast_idle``: one CTA, no work items), after a memset
(with and without the safe launch before it), and after a cuBLAS matmul (``[4096, 4096] @ [4096, 2048]``,
as a layer's projection runs before its attention) with and without the safe launch after it. One JSON
line per case: the microseconds per launch (or per turn), the per-kernel durations of each sequence
(``kernels``), and how many flags the fast launch set (0 on these finite inputs). Two attributions of
the fast launch's cost: ``fast_nocheck`` (the fast launch without its row check, ``profile=3``: timing
only) back to back, and ``fast_shared`` (the fast binary asking for the safe binary's dynamic shared
memory, ``shared`` in the record: does a change of size between launches cost the next one?) alone and
in turn with the safe launch. ``--src TREE`` runs on another source tree; one from before the
masked-key rule (no safe launch) reports its launch alone and after the matmul (``plan``).

Needs a Hopper GPU (sm_90) with torch and triton's Gluon; without one it exits 2 saying so.

Usage::

    python benchmarks/probes/safe_launch.py [--out FILE.jsonl] [--windows none,1023,127] [--src TREE]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, HERE)
from _outputs import device_problem, fail, force_help, give_up, open_records  # noqa: E402

HQ, HKV, D, BS, T = 32, 8, 128, 64, 8192


def _windows(text: str) -> list[int | None]:
    """``--windows``: ``none`` (causal) or a window of at least 1, comma separated."""
    out: list[int | None] = []
    for part in text.split(","):
        part = part.strip().lower()
        if part == "none":
            out.append(None)
        elif part.isdigit() and int(part) >= 1:
            out.append(int(part))
        else:
            raise argparse.ArgumentTypeError(f"{part!r} is neither 'none' nor a window >= 1")
    return out


def _per_turn_us(fns) -> float:
    """Microseconds per turn of ``fns`` (called in order), ten turns per CUDA-graph replay (the median
    of decode_probe's graph timing, which counts per launch)."""
    from decode_probe import _graph_us

    return round(_graph_us(fns, 10) * len(fns), 1)


def _kernel_us(fns, names: list[str], rounds: int = 10) -> dict:
    """Each kernel's own duration (median us over three replays of a CUDA graph holding ``rounds``
    turns of ``fns``) from ``torch.profiler``, by ``names`` (one per launch of a turn, in order): the
    prefill's launches told apart by their order, every other kernel (cuBLAS may launch several for one
    matmul) under the turn's one other name."""
    import statistics

    import torch
    from decode_probe import _captured
    from torch.profiler import ProfilerActivity, profile

    g = _captured(fns, rounds)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
    events = sorted(
        (e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start
    )
    prefill = [n for n in names if n.startswith(("fast", "safe", "plan"))]
    other = [n for n in names if n not in prefill]
    runs: dict[str, list[float]] = {}
    seen = 0
    for e in events:
        if "_hopper_prefill_kernel" in e.name:
            name = prefill[seen % len(prefill)]
            seen += 1
        else:
            name = other[0]
        runs.setdefault(name, []).append(e.time_range.end - e.time_range.start)
    return {n: round(statistics.median(v), 1) for n, v in runs.items()}


def _inputs(window: int | None):
    """One case's inputs and plan: ``(hp, plan, q, out, sinks, cu, dec, table)``, the plan over random
    caches (8192 tokens of one request, physical blocks in random order) from the imported tree."""
    import torch

    from fastdeploy_paddlefleet.kernels import hopper_prefill as hp

    gen = torch.Generator(device="cuda").manual_seed(0)
    nb = T // BS + 4
    kw = dict(device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(nb, HKV, BS, D, generator=gen, **kw)
    vc = torch.randn(nb, HKV, BS, D, generator=gen, **kw)
    q = torch.randn(T, HQ, D, generator=gen, **kw)
    out = torch.empty_like(q)
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    dec = torch.zeros(1, dtype=torch.int32, device="cuda")
    table = torch.randperm(nb, device="cuda", generator=gen)[: T // BS].int()[None].contiguous()
    sinks = torch.zeros(HQ, device="cuda")
    plan = hp.HopperPlan(kc, vc, HQ, sinks, qk_scale=1.4426950408889634 / D**0.5, sink_mode=1, headwise=False,
                         has_window=window is not None, window=window or 0, win_h0=0, win_h1=HKV)  # fmt: skip
    return hp, plan, q, out, sinks, cu, dec, table


def _matmul():
    """A cuBLAS matmul as a layer's projection runs before its attention (``[4096, 4096] @ [4096, 2048]``)."""
    import torch

    kw = dict(device="cuda", dtype=torch.bfloat16)
    a, b, c = torch.randn(4096, 4096, **kw), torch.randn(4096, 2048, **kw), torch.empty(4096, 2048, **kw)
    return lambda: torch.mm(a, b, out=c)


def run_plain_case(window: int | None) -> dict:
    """A tree from before the masked-key rule (``--src``; its plan has no safe launch): its launch alone
    and after the matmul, per-kernel durations."""
    hp, plan, q, out, sinks, cu, dec, table = _inputs(window)

    def plan_run():
        plan.run(q, out, cu, dec, table)

    matmul = _matmul()
    sequences = {"plan": ([plan_run], ["plan"]), "matmul,plan": ([matmul, plan_run], ["matmul", "plan"])}
    return dict(
        window=window, tree="before the masked-key rule", plan_us=_per_turn_us([plan_run]),
        kernels={k: _kernel_us(fns, names) for k, (fns, names) in sequences.items()},
    )  # fmt: skip


@contextlib.contextmanager
def _asking_shared(compiled, shared: int):
    """Launches of the compiled kernel ``compiled`` through Triton's path ask for ``shared`` bytes of
    dynamic shared memory meanwhile (its packed launch metadata: Triton 3.6's ``(warps, ctas, shared)``)."""
    packed = compiled.packed_metadata
    compiled.packed_metadata = (*packed[:-1], shared)
    try:
        yield
    finally:
        compiled.packed_metadata = packed


def run_case(window: int | None) -> dict:
    """One case's record (see the module docstring)."""
    import torch

    hp, plan, q, out, sinks, cu, dec, table = _inputs(window)
    n_items, grid = plan._items(T, 1)
    tail = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), plan.stride_vr, table.stride(0),
            table.shape[1], plan.n_pages, T, 1, 2, *plan.scalars, n_items)  # fmt: skip
    args = (
        q,
        out,
        plan.value_cache,
        plan.k_desc,
        plan.v_desc,
        sinks,
        cu,
        dec,
        table,
        table,
        plan.redo,
        *tail,
    )

    def fast():
        hp._hopper_prefill_kernel[grid](*args, **plan._consts[False])

    def safe():
        hp._hopper_prefill_kernel[grid](*args, **plan._consts["safe"])

    err = torch.zeros(8, dtype=torch.int32, device="cuda")
    args_err = args[:9] + (err,) + args[10:]

    def fast_with_errors():  # another binary of the fast launch's work (HAS_ERR)
        hp._hopper_prefill_kernel[grid](*args_err, **plan._consts[True])

    def safe_one_cta():
        hp._hopper_prefill_kernel[(1,)](*args, **plan._consts["safe"])

    args_idle = args[:-1] + (0,)  # no work items: the binary's prologue and exit only

    def fast_idle():  # the fast binary again, on one CTA, with nothing to do
        hp._hopper_prefill_kernel[(1,)](*args_idle, **plan._consts[False])

    def memset():  # a small kernel of another kind (no shared memory)
        x.zero_()

    def fast_nocheck():  # the fast launch without its row check (profile=3: timing only)
        hp._hopper_prefill_kernel[grid](*args, **dict(plan._consts[False], PROFILE=3))

    x = torch.zeros(16, device="cuda")
    matmul = _matmul()

    def empty():
        _empty_kernel()[grid](x)

    fast()
    torch.cuda.synchronize()
    flags = int((plan.redo != 0).sum())
    sequences = {
        "fast": ([fast], ["fast"]),
        "fast,safe": ([fast, safe], ["fast", "safe"]),
        "fast,safe_one_cta": ([fast, safe_one_cta], ["fast", "safe"]),
        "fast,empty": ([fast, empty], ["fast", "empty"]),
        "fast,fast_err": ([fast, fast_with_errors], ["fast", "fast_err"]),
        "fast,fast_idle": ([fast, fast_idle], ["fast", "fast_idle"]),
        "fast,memset": ([fast, memset], ["fast", "memset"]),
        "fast,safe,memset": ([fast, safe, memset], ["fast", "safe", "memset"]),
        "matmul,fast": ([matmul, fast], ["matmul", "fast"]),
        "matmul,fast,safe": ([matmul, fast, safe], ["matmul", "fast", "safe"]),
        "fast_nocheck": ([fast_nocheck], ["fast_nocheck"]),
    }
    kernels = {k: _kernel_us(fns, names) for k, (fns, names) in sequences.items()}
    # the fast binary asking for the safe one's dynamic shared memory: is the slowdown after a safe
    # launch a change of shared-memory size between the launches?
    compiled_fast = hp._hopper_prefill_kernel[grid](*args, **plan._consts[False])
    compiled_safe = hp._hopper_prefill_kernel[grid](*args, **plan._consts["safe"])
    shared = (compiled_fast.metadata.shared, compiled_safe.metadata.shared)
    if hasattr(compiled_fast, "packed_metadata"):
        with _asking_shared(compiled_fast, shared[1]):
            for k, fns, names in (("fast_shared", [fast], ["fast_shared"]),
                                  ("fast_shared,safe", [fast, safe], ["fast_shared", "safe"])):  # fmt: skip
                kernels[k] = _kernel_us(fns, names)
    return dict(
        window=window, grid=grid[0], flags_set=flags, shared=shared, fast_us=_per_turn_us([fast]),
        safe_us=_per_turn_us([safe]), fast_then_safe_us=_per_turn_us([fast, safe]), kernels=kernels,
    )  # fmt: skip


@functools.cache
def _empty_kernel():
    """A Triton kernel that does nothing (one launch's cost between two others)."""
    import triton

    @triton.jit
    def _nothing(X):
        pass

    return _nothing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="Needs a Hopper GPU (sm_90).")
    ap.add_argument("--out", default=None, help="also append the JSON lines to this .jsonl file")
    ap.add_argument("--force", action="store_true", help=force_help("the --out file"))
    ap.add_argument(
        "--windows",
        default="none,1023,127",
        type=_windows,
        help="comma list of the cases' windows, 'none' for causal (default: none,1023,127)",
    )
    ap.add_argument(
        "--src",
        default=None,
        help="import fastdeploy_paddlefleet from this source tree (default: this checkout's src/); a tree "
        "from before the masked-key rule times its one launch alone and after the matmul",
    )
    a = ap.parse_args(argv)
    if a.src is not None and not os.path.isdir(os.path.join(a.src, "fastdeploy_paddlefleet")):
        return fail(ValueError(f"--src {a.src!r} holds no fastdeploy_paddlefleet package"))
    existed = a.out is not None and os.path.lexists(a.out)
    try:
        fh = open_records(a.out, script="safe_launch", force=a.force)  # refused before any work
    except ValueError as e:
        return fail(e)
    problem = device_problem("benchmarks/probes/safe_launch.py")
    if problem is None:
        sys.path.insert(0, os.path.abspath(a.src) if a.src else os.path.join(ROOT, "src"))
        import torch

        from fastdeploy_paddlefleet.kernels import hopper_prefill as hp

        if not hp.gluon_available() or not hp.is_hopper(torch.device("cuda")):
            problem = "benchmarks/probes/safe_launch.py needs a Hopper GPU (sm_90) and triton's Gluon"
    if problem:
        return give_up(fh, a.out, existed, problem)
    plain = not hasattr(hp, "safe_key")  # a tree from before the masked-key rule: one launch a step
    for window in a.windows:
        rec = run_plain_case(window) if plain else run_case(window)
        print(json.dumps(rec), flush=True)
        if fh is not None:
            fh.record(rec)
    if fh is not None:
        fh.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
