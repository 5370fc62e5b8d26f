"""Where a Hopper prefill work item's time goes: SM clock stamps inside the kernel, per CTA and item.

The script copies ``kernels/hopper_prefill.py``'s source, inserts ``%clock64`` reads (inline PTX, thread 0
of each partition, each stamp after a value it must wait for) at fixed points of the consumer and
producer loops, writes them into a trace buffer and reports the median of each segment per item, in ns
(cycles / the clock rate measured over the launch). The kernel in the package is not changed; a stamp
point whose source line moved makes the script stop with the anchor's name.

Segments (per work item of one CTA): consumer 0 ``c_item`` (the item's description: ``_work_item``'s
loads), ``c_qwait`` (its Q buffer), ``c_tiles`` (every key tile, first tile and last ``P @ V``
included), ``c_tail`` (normalise, store, next loop step); consumer 1 ``c1_qwait``; producer
``p_item``, ``p_q`` (Q copies issued), ``p_tile0`` (the first K/V tile issued, ring slots waited
for), ``p_rest`` (the other tiles), ``p_tail``.

Usage::

    python benchmarks/probes/hopper_probe.py [--out FILE.json] [--cases swa1024-sinks,causal,...]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))  # benchmarks/probes/
BENCH = os.path.dirname(HERE)  # benchmarks/: _outputs.py
ROOT = os.path.dirname(BENCH)
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
from _outputs import Refused, choose, claim, fail, force_help, mark, replacing  # noqa: E402

SRC = os.path.join(ROOT, "src", "fastdeploy_paddlefleet", "kernels", "hopper_prefill.py")
MAX_ITEMS = 64  # work items per CTA the trace holds
SLOTS = 16  # stamps per item: consumer 0 at 0-3, consumer 1 at 4-7, producer at 8-12

# (case, q heads, kv heads, head dim, window_left or None, learnable sinks)
CASES = {
    "swa1024-sinks": (32, 8, 128, 1023, True),
    "swa256-sinks": (32, 8, 128, 255, True),
    "causal": (32, 8, 128, None, False),
    "gptoss-swa128-sinks": (64, 8, 64, 127, True),
}

_STAMP = """    @gluon.jit
    def _stamp(Trace, base, slot, dep):
        # probe: this SM's clock, read after dep ([128] int32) is ready, into Trace[base + slot]
        t = gl.inline_asm_elementwise(
            "mov.u64 $0, %clock64;", "=l,r", [dep], dtype=gl.int64, is_pure=False, pack=1
        )
        offs = gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [4], [0]))
        gl.store(Trace + base + slot + offs * 0, t, mask=offs == 0)

"""
_TOK = "gl.zeros([128], gl.int32, gl.BlockedLayout([1], [32], [4], [0]))"
_ITEM = f"(gl.program_id(0) * {MAX_ITEMS} + li) * {SLOTS}"


def _lines(indent: int, *lines: str) -> str:
    return "".join(" " * indent + line + "\n" for line in lines)


def _after(name: str, anchor: str, text: str, count: int = 1) -> tuple:
    return name, anchor, anchor + text, count


def _before(name: str, anchor: str, text: str, count: int = 1) -> tuple:
    return name, anchor, text + anchor, count


_WORK_ITEM_END = _lines(12, "    HKV, TILE_Q, BLOCK_N, HEADWISE, HAS_WINDOW,", ")  # fmt: skip")
_LOOP = "for step in range(gl.program_id(0), n_items, gl.num_programs(0)):"
# the two loops start alike: told apart by the line before them
_PRODUCER_LOOP = _lines(
    8,
    "offs_v = gl.arange(0, DV, layout=gl.SliceLayout(0, ld))",
    "it = 0",
    "qi = 0",
    "own = 0  # V tiles copied on v_own (its phase; only the safe launch uses it)",
    "pend = -1  # the stage of a V tile on v_own not yet cleaned (-1: none)",
    _LOOP,
)
_CONSUMER_FLAG = (
    "flag = Redo + 2 * gl.program_id(0) + HALF + offs_om * 0  # [BLOCK_M] pointers to this consumer's flag"
)
_CONSUMER_LOOP = _lines(16, "tok = _turn(tok, 0, 2)") + _lines(8, "it = 0", "qi = 0", _CONSUMER_FLAG, _LOOP)
_PEELED_END = "PROFILE, PINGPONG,\n                        SAFE,\n                    )  # fmt: skip\n"
# the passes' signatures end alike in the wrapper and the pass: told apart by the docstring after them
_PRODUCE_PASS_SIG = (
    'Q_ASYNC: gl.constexpr, SAFE: gl.constexpr,\n    ):  # fmt: skip\n        """The producer\'s walk'
)
_CONSUMER_SIG = "O_VEC: gl.constexpr,\n        SAFE: gl.constexpr,\n    ):"
_STORE_END = "offs_om, offs_od, G, GP)\n"
_ITEM_STAMP = "_stamp(Trace, tb, {slot}, {tok} + valid.to(gl.int32) + ctx)"
# (name, source text, replacement, occurrences): each anchor must match exactly that often
EDITS = [
    _before("stamp helper", "    @gluon.jit\n    def _tanh(x):", _STAMP),
    (
        "producer signature",
        'Q_ASYNC: gl.constexpr, SAFE: gl.constexpr,\n    ):  # fmt: skip\n        """This CTA\'s items',
        "Q_ASYNC: gl.constexpr, SAFE: gl.constexpr, Trace,\n    ):  # fmt: skip\n"
        '        """This CTA\'s items',
        1,
    ),
    (
        "producer pass signature",
        _PRODUCE_PASS_SIG,
        _PRODUCE_PASS_SIG.replace("SAFE: gl.constexpr,", "SAFE: gl.constexpr, Trace,").replace(
            "    ):  # fmt: skip\n", "    ):  # fmt: skip\n" + _lines(8, f"ptok = {_TOK}", "li = 0")
        ),
        1,
    ),
    (
        "producer pass call",
        "Q_ASYNC, SAFE,\n            )  # fmt: skip",
        "Q_ASYNC, SAFE, Trace,\n            )  # fmt: skip",
        1,
    ),
    (
        "producer loop",
        _PRODUCER_LOOP + _lines(12, "item = _scheduled(step, n_items, SNAKE)"),
        _PRODUCER_LOOP
        + _lines(
            12, f"tb = {_ITEM}", "_stamp(Trace, tb, 8, ptok)", "item = _scheduled(step, n_items, SNAKE)"
        ),
        1,
    ),
    (
        "producer item described",
        _WORK_ITEM_END + _lines(12, "if valid:", "    kv_len = ctx + q_len"),
        _WORK_ITEM_END
        + _lines(12, _ITEM_STAMP.format(slot=9, tok="ptok"), "if valid:", "    kv_len = ctx + q_len"),
        1,
    ),
    _after("producer Q issued", "Q_BUFS, Q_ASYNC)  # fmt: skip\n", _lines(16, "_stamp(Trace, tb, 10, ptok)")),
    _after(
        "producer first tile issued",
        _lines(20, "it += 1"),
        _lines(20, "if j == 0:", "    _stamp(Trace, tb, 11, ptok)"),
    ),
    (
        "producer tiles issued",
        _lines(16, "qi += 1") + "\n    @gluon.jit\n    def _copy_v(",
        _lines(16, "qi += 1", "_stamp(Trace, tb, 12, ptok)")
        + _lines(12, "li += 1")
        + "\n    @gluon.jit\n    def _copy_v(",
        1,
    ),
    (
        "consumer signatures",
        _CONSUMER_SIG,
        _CONSUMER_SIG.replace("SAFE: gl.constexpr,", "SAFE: gl.constexpr, Trace,"),
        2,
    ),
    (
        "consumer pass call",
        "Q_ASYNC, O_VEC, SAFE,\n            )  # fmt: skip",
        "Q_ASYNC, O_VEC, SAFE, Trace,\n            )  # fmt: skip",
        1,
    ),
    (
        "consumer loop",
        _CONSUMER_LOOP + _lines(12, "item = _scheduled(step, n_items, SNAKE)"),
        _CONSUMER_LOOP.replace("qi = 0\n", "qi = 0\n        li = 0\n")
        + _lines(
            12,
            f"tb = {_ITEM} + HALF * 4",
            "_stamp(Trace, tb, 0, tok)",
            "item = _scheduled(step, n_items, SNAKE)",
        ),
        1,
    ),
    (
        "consumer item described",
        _WORK_ITEM_END + _lines(12, "if valid:", "    tok0 = tile_tok0 + HALF * BLOCK_Q"),
        _WORK_ITEM_END
        + _lines(
            12, _ITEM_STAMP.format(slot=1, tok="tok"), "if valid:", "    tok0 = tile_tok0 + HALF * BLOCK_Q"
        ),
        1,
    ),
    _after(
        "consumer Q ready",
        _lines(16, "mbarrier.wait(q_ready.index(qs), (qi // Q_BUFS) & 1)"),
        _lines(16, "_stamp(Trace, tb, 2, tok)"),
    ),
    _after(
        "consumer tiles done",
        _PEELED_END,
        _lines(20, "_stamp(Trace, tb, 3, tok + gl.sum(l_i, 0).to(gl.int32) * 0)"),
    ),
    _after("consumer loop end", _STORE_END, _lines(12, "li += 1")),
    (
        "kernel signature",
        "SAFE: gl.constexpr = False,\n    ):",
        "SAFE: gl.constexpr = False, Trace=None,\n    ):",
        1,
    ),
    (
        "consumer arguments",
        "Q_ASYNC, O_VEC, SAFE,\n                )),",
        "Q_ASYNC, O_VEC, SAFE, Trace,\n                )),",
        2,
    ),
    (
        "producer arguments",
        "SNAKE, Q_ASYNC, SAFE,\n                )),",
        "SNAKE, Q_ASYNC, SAFE, Trace,\n                )),",
        1,
    ),
    ("package import", "from .. import envs", "from fastdeploy_paddlefleet import envs", 1),
    (
        "support import",
        "from .hopper_support import",
        "from fastdeploy_paddlefleet.kernels.hopper_support import",
        1,
    ),
]


def patched_source(src: str | None = None) -> str:
    """The kernel module's source with the stamps in; ``ValueError`` naming an anchor that is not found
    exactly as often as expected (the kernel changed: move the stamp)."""
    text = open(SRC).read() if src is None else src
    for name, old, new, count in EDITS:
        found = text.count(old)
        if found != count:
            raise ValueError(
                f"stamp point {name!r}: its anchor occurs {found} times in the kernel, expected {count}"
            )
        text = text.replace(old, new)
    return text


def load_probe():
    """Import the stamped copy as a module of its own."""
    path = os.path.join(tempfile.mkdtemp(prefix="fdfleet-probe-"), "hopper_probe_kernel.py")
    with open(path, "w") as f:
        f.write(patched_source())
    spec = importlib.util.spec_from_file_location("hopper_probe_kernel", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def segments(trace: list, ms: float) -> dict:
    """Median ns per segment and item (module docstring) from ``trace [ctas][MAX_ITEMS][SLOTS]`` cycles
    and the launch's time (the clock rate: the median CTA's stamped span over ``ms``)."""
    names = (
        "c_item",
        "c_qwait",
        "c_tiles",
        "c_tail",
        "c1_qwait",
        "p_item",
        "p_q",
        "p_tile0",
        "p_rest",
        "p_tail",
    )
    seg: dict[str, list] = {k: [] for k in names}
    spans = []
    for cta in trace:
        items = [r for r in cta if r[0] or r[8]]
        if not items:
            continue
        stamps = [x for r in items for x in r if x]
        spans.append(max(stamps) - min(stamps))
        for i, r in enumerate(items):
            nxt = items[i + 1] if i + 1 < len(items) else None
            if r[3]:
                seg["c_item"].append(r[1] - r[0])
                seg["c_qwait"].append(r[2] - r[1])
                seg["c_tiles"].append(r[3] - r[2])
                if nxt and nxt[0]:
                    seg["c_tail"].append(nxt[0] - r[3])
            if r[6]:
                seg["c1_qwait"].append(r[6] - r[5])
            if r[12]:
                seg["p_item"].append(r[9] - r[8])
                seg["p_q"].append(r[10] - r[9])
                seg["p_tile0"].append(r[11] - r[10])
                seg["p_rest"].append(r[12] - r[11])
                if nxt and nxt[8]:
                    seg["p_tail"].append(nxt[8] - r[12])
    per_ns = statistics.median(spans) / (ms * 1e6)
    return {
        "ghz": round(per_ns, 3),
        **{k: round(statistics.median(v) / per_ns, 1) if v else None for k, v in seg.items()},
    }


def run(cases: list[str]) -> dict:
    import attention as A
    import torch

    mod = load_probe()
    res = {}
    for name in cases:
        hq, hkv, d, window, with_sinks = CASES[name]
        n = A.SH["n"]
        b = A.paged_batch([0], [n], hq, hkv, d, d, seed=2)
        q, vc, table = b["q"], b["vc"], b["table"]
        sinks = torch.randn(hq, device=q.device) if with_sinks else None
        plan = mod.HopperPlan(b["kc"], vc, hq, sinks, qk_scale=1.4426950408889634 / math.sqrt(d),
                              sink_mode=1 if with_sinks else 0, headwise=False, has_window=window is not None,
                              window=window or 0, win_h0=0, win_h1=hkv)  # fmt: skip
        out = torch.empty(n, hq, d, device=q.device, dtype=q.dtype)
        n_items = (n // plan.tile_q + 1) * plan.hkv
        grid = (min(n_items, plan.ctas),)
        if -(-n_items // grid[0]) > MAX_ITEMS:
            raise ValueError(
                f"{name}: {n_items} items over {grid[0]} CTAs exceed the trace's {MAX_ITEMS} per CTA"
            )
        trace = torch.zeros(grid[0] * MAX_ITEMS * SLOTS, dtype=torch.int64, device=q.device)
        sizes = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), vc.stride(2), table.stride(0))
        sizes += (table.shape[1], plan.n_pages, n, 1, 2, *plan.scalars, n_items)
        args = (
            q,
            out,
            vc,
            plan.k_desc,
            plan.v_desc,
            sinks if with_sinks else q,
            b["cu"],
            b["dec"],
            table,
            table,
            plan.redo,  # the fast launch's flags (the probe times the fast launch alone)
        )
        args += sizes

        def launch(args=args, grid=grid, trace=trace, plan=plan):
            mod._hopper_prefill_kernel[grid](*args, Trace=trace, **plan._consts[False])

        launch()
        torch.cuda.synchronize()
        ms = A.bench(launch)
        trace.zero_()
        launch()
        torch.cuda.synchronize()
        tr = trace.view(grid[0], MAX_ITEMS, SLOTS).cpu().tolist()
        res[name] = {"ms": round(ms, 4), "items": n_items, "ctas": grid[0], "tile_q": plan.tile_q,
                     "median_ns": segments(tr, ms)}  # fmt: skip
        print(name, json.dumps(res[name]), flush=True)
        del b, out, trace
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma list (default: %(default)s)")
    ap.add_argument("--out", default=None, help="write the summary here (JSON)")
    ap.add_argument("--force", action="store_true", help=force_help("the --out file"))
    ap.add_argument("--json", action="store_true", help="the summary as one JSON object on stdout")
    args = ap.parse_args(argv)
    try:
        names = choose(args.cases, CASES, "cases")
        out = claim(args.out, script="hopper_probe", force=args.force) if args.out else None
    except ValueError as e:
        return fail(e)
    res = run(names)
    if out is not None:
        try:
            with replacing(out) as tmp:
                tmp.write_text(json.dumps(mark(res, "hopper_probe"), indent=1) + "\n")
        except Refused as e:
            return fail(e)
    if args.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
