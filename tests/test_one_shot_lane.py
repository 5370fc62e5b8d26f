"""The one-shot wrappers' kept lane (issue 20): ``paged_attention`` / ``write_kv_cache`` calls whose
kernels are compiled and kept read their step from the tensors into locals (no ``LaunchStep``) and
launch by addresses.

The reference is the plans' own path on the same tensors: a freshly built plan, a ``LaunchStep`` and
``run_step``. Every kept kernel must get the very same key, grid, arguments (addresses, strides, sizes,
scalars) and stream, except fresh allocations (a new output, the split decode's partial buffers).
Kernels are recorders and every tensor reads as on a GPU, so both paths launch directly. A repeated call
after a tensor changed in place (``resize_``, ``as_strided_``, ``set_``, ``.data =`` with the same
address and version, a new tensor at a recycled address) must launch what a fresh plan launches for the
changed tensors: nothing derived from a tensor may survive from one call to the next.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from test_triton_kernels import make_step  # noqa: E402

from fastdeploy_paddlefleet.kernels import cache_write as cw  # noqa: E402
from fastdeploy_paddlefleet.kernels import paged_attention as pa  # noqa: E402
from fastdeploy_paddlefleet.kernels.launch import direct as _launch  # noqa: E402
from fastdeploy_paddlefleet.kernels.launch.direct import KernelCache, LaunchStep, PlanMemo  # noqa: E402

# CPU tensors on any machine: the kept kernels are recorders and tensors read as on a GPU (``kept``), so
# the file checks the same launches with or without one (on a GPU, CUDA tensors would put the sinks'
# float32 copy and the tests' own buffers on another device than the step's)
SMALL = dict(hkv=2, group=2, dqk=16, dv=16, block_size=8, device=torch.device("cpu"))
STEPS = {  # (context, new tokens) per request
    "decode": [(9, 1), (20, 1), (3, 1)],
    "decode-split": [(400, 1), (70, 1)],  # two requests, long context: the decode splits, the reduce merges
    "prefill": [(0, 8), (5, 8)],
    "mixed": [(9, 4), (20, 1)],
}
STREAM = 0x51


class Recorder(KernelCache):
    """A kernel cache as on a GPU with every kernel compiled and kept (``direct``, addresses); its kept
    kernels record ``(key, grid, args, stream)``; Triton's path raises."""

    calls: list = []

    def __init__(self, device_index=None) -> None:
        super().__init__(None)
        self.direct, self.addresses, self.own, self.device_index = True, True, False, 0

    def stream(self) -> int:
        return STREAM

    def kernel(self, key):
        if key is None:
            return None

        def hit(grid, args, stream):
            bad = [type(a).__name__ for a in args if hasattr(a, "data_ptr")]
            if bad:
                raise TypeError(f"a kept kernel was given tensors {bad}")
            Recorder.calls.append((key, tuple(grid), tuple(_snapshot(a) for a in args), stream))

        return hit

    def launch(self, fn, key, grid, args, consts, stream):
        raise RuntimeError(f"Triton's path taken (key {key!r})")


def _snapshot(a):
    """A TMA descriptor argument as what it reads at this launch: its base's address, shape, strides,
    block (a one-shot plan's descriptors hold no cache between calls); any other argument as it is."""
    if hasattr(a, "block_shape") and hasattr(a, "base"):
        base = a.base.data_ptr() if hasattr(a.base, "data_ptr") else a.base
        return ("desc", base, tuple(a.shape), tuple(a.strides), tuple(a.block_shape))
    return a


@pytest.fixture
def kept(monkeypatch):
    """Recorder kernels for every plan built now, tensors that read as on a GPU, empty one-shot memos;
    returns the count of ``LaunchStep``s each wrapper builds (the lane builds none)."""
    monkeypatch.setattr(pa, "KernelCache", Recorder)
    monkeypatch.setattr(cw, "KernelCache", Recorder)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True), raising=False)
    monkeypatch.setattr(pa, "_PLANS", PlanMemo())
    monkeypatch.setattr(cw, "_PLANS", PlanMemo())
    monkeypatch.setattr(Recorder, "calls", [])
    steps = {"attend": 0, "write": 0}

    def counting(name):
        def fill(s, *args):
            steps[name] += 1
            return _launch.fill_step(s, *args)

        return fill

    monkeypatch.setattr(pa, "fill_step", counting("attend"))
    monkeypatch.setattr(cw, "fill_step", counting("write"))
    return steps


def _recorded(fn):
    Recorder.calls.clear()
    res = fn()
    return res, list(Recorder.calls)


def _fresh_positions(key, grid, out_given: bool, sinks: bool) -> set:
    """Argument positions that hold fresh allocations: a new output, the prefill's flags for its safe
    launch, the split decode's partials."""
    kind = key[0]
    if kind == "reduce":
        return {0, 1} | (set() if out_given else {2}) | (set() if sinks else {3})
    fresh = set() if out_given else {3}
    if kind in ("prefill", "prefill-safe"):
        fresh |= {11}
    if kind == "decode" and grid[2] > 1:
        fresh |= {6, 7}
    return fresh


def _assert_same_launches(got, want, res_got, out_given: bool, sinks: bool) -> None:
    assert [c[0] for c in got] == [c[0] for c in want]  # the same kernels, by key
    for (key, grid, args, stream), (_, w_grid, w_args, w_stream) in zip(got, want, strict=True):
        assert grid == w_grid and stream == w_stream == STREAM, key
        fresh = _fresh_positions(key, grid, out_given, sinks)
        assert [a for i, a in enumerate(args) if i not in fresh] == [
            a for i, a in enumerate(w_args) if i not in fresh
        ], key
        if key[0] in ("prefill", "prefill-safe", "decode"):
            assert args[3] == res_got.data_ptr(), key


def _attend_kw(s, sinks: bool) -> dict:
    kw = dict(scale=0.25)
    if sinks:
        sinks_t = torch.linspace(-1, 1, s.q.shape[1])  # a window on one kv head: the decode still splits
        kw.update(window_left=5, sliding_heads=(0, 1), sink_kind="learnable", sinks=sinks_t)
    return kw


def _reference_attend(q, kc, vc, cu, dec, table, *, out, errors, mq, mc, num_splits=None, **kw):
    """What a fresh plan launches for these tensors (its own LaunchStep, ``run_step``)."""
    plan = pa.AttentionPlan(kc, vc, q, **kw)
    step = LaunchStep(cu, dec, table, max_q_len=mq, max_context_len=mc, errors=errors)
    return _recorded(lambda: plan.run_step(q, step, out=out, num_splits=num_splits))


@pytest.mark.parametrize("sinks", [False, True], ids=["full", "window-sinks"])
@pytest.mark.parametrize("errors", [False, True], ids=["no-flag", "flag"])
@pytest.mark.parametrize("out_given", [False, True], ids=["new-out", "out"])
@pytest.mark.parametrize("name", list(STEPS))
def test_attention_lane_launches_what_a_fresh_plan_launches(kept, name, out_given, errors, sinks):
    s = make_step(STEPS[name], **SMALL)
    kw = _attend_kw(s, sinks)
    flag = torch.zeros(8, dtype=torch.int32) if errors else None
    mq = max(n for _, n in STEPS[name]) if name != "mixed" else None  # mixed: no host maxima
    mc = max(c + n for c, n in STEPS[name]) if name == "decode-split" else None
    for _ in range(2):  # the call that builds the memo's plan, and one that finds it
        out = torch.empty(s.q.shape[0], s.q.shape[1], 16) if out_given else None
        res, got = _recorded(
            lambda out=out: pa.paged_attention(
                s.q,
                s.key_cache,
                s.value_cache,
                s.cu,
                s.dec,
                s.table,
                out=out,
                errors=flag,
                max_q_len=mq,
                max_context_len=mc,
                **kw,
            )  # fmt: skip
        )
        _, want = _reference_attend(
            s.q, s.key_cache, s.value_cache, s.cu, s.dec, s.table, out=out, errors=flag, mq=mq, mc=mc, **kw
        )
        _assert_same_launches(got, want, res, out_given, sinks)
        assert res.shape == (s.q.shape[0], s.q.shape[1], 16) and (out is None or res is out)
    kinds = {c[0][0] for c in got}
    prefill = {"prefill", "prefill-safe"}  # its fast and safe launches
    assert kinds == {"decode-split": {"decode", "reduce"}, "decode": {"decode"}, "prefill": prefill}.get(
        name, prefill | {"decode"}
    )
    assert name != "decode-split" or got[0][1][2] > 1  # it did split
    assert kept["attend"] == 0  # every call served by the lane: no LaunchStep built


@pytest.mark.parametrize("headwise", [False, True])
@pytest.mark.parametrize("errors", [False, True], ids=["no-flag", "flag"])
def test_write_lane_launches_what_a_fresh_plan_launches(kept, errors, headwise):
    s = make_step(STEPS["mixed"], headwise=headwise, **SMALL)
    flag = torch.zeros(8, dtype=torch.int32) if errors else None
    args = (s.k, s.v, s.key_cache, s.value_cache, s.bid, s.cu, s.dec, s.table)
    for _ in range(2):
        _, got = _recorded(lambda: cw.write_kv_cache(*args, headwise=headwise, errors=flag))
        plan = cw.CacheWritePlan(s.key_cache, s.value_cache, headwise=headwise)
        step = LaunchStep(s.cu, s.dec, s.table, s.bid, errors=flag)
        _, want = _recorded(lambda plan=plan, step=step: plan.run_step(s.k, s.v, step))
        assert len(got) == 1 and got == want
    assert kept["write"] == 0


def test_lanes_step_aside_for_what_they_do_not_launch(kept, monkeypatch):
    """A kernel not kept, a misaligned view, a CPU tensor: the lane launches nothing and the plans' path
    takes the call (here: Triton's, which the recorder refuses); a 1-D table or no batch ids: the plans'
    path raises what it raises."""
    s = make_step(STEPS["decode"], **SMALL)
    call = dict(scale=0.25, max_q_len=1)
    attend = (s.key_cache, s.value_cache, s.cu, s.dec)
    with monkeypatch.context() as m:
        m.setattr(Recorder, "kernel", lambda self, key: None)  # nothing kept
        with pytest.raises(RuntimeError, match="Triton's path taken"):
            pa.paged_attention(s.q, *attend, s.table, **call)
        with pytest.raises(RuntimeError, match="Triton's path taken"):
            cw.write_kv_cache(s.k, s.v, s.key_cache, s.value_cache, s.bid, s.cu, s.dec, s.table)
    assert kept == {"attend": 1, "write": 1}
    shifted = torch.zeros(s.q.numel() + 1)[1:].view(s.q.shape)  # 4 bytes past a 16-byte boundary
    shifted.copy_(s.q)
    with pytest.raises(RuntimeError, match="Triton's path taken"):  # Triton specialises on alignment
        pa.paged_attention(shifted, *attend, s.table, **call)
    with pytest.raises(ValueError, match="block_tables must be 2-D"):
        pa.paged_attention(s.q, *attend, s.table[0], **call)
    with pytest.raises(ValueError, match="block_tables must be 2-D"):
        cw.write_kv_cache(s.k, s.v, s.key_cache, s.value_cache, s.bid, s.cu, s.dec, s.table[0])
    with pytest.raises(ValueError, match="needs batch_id_per_token"):
        cw.write_kv_cache(s.k, s.v, s.key_cache, s.value_cache, None, s.cu, s.dec, s.table)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: False), raising=False)
    with pytest.raises(RuntimeError, match="Triton's path taken"):
        pa.paged_attention(s.q, *attend, s.table, **call)
    with pytest.raises(RuntimeError, match="Triton's path taken"):
        cw.write_kv_cache(s.k, s.v, s.key_cache, s.value_cache, s.bid, s.cu, s.dec, s.table)
    # steps built: the first call, the misaligned q (attend) / no batch ids (write), the CPU tensors; the
    # 1-D tables are refused while the step's values are read, before any step exists
    assert kept == {"attend": 3, "write": 3}


def _wide(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` (last dim contiguous) at the start of a buffer with room for rows twice as wide."""
    buf = torch.zeros(x.numel() * 2, dtype=x.dtype)
    view = buf[: x.numel()].view(x.shape)
    view.copy_(x)
    return view


def _wider_rows(x: torch.Tensor) -> tuple:
    """``x``'s shape with every outer stride doubled (``x`` from :func:`_wide`: the memory is there)."""
    return x.shape, (*(2 * st for st in x.stride()[:-1]), 1)


def _narrower(x: torch.Tensor) -> tuple:
    """``x``'s shape less one entry of its first dim, same strides."""
    return (x.shape[0] - 1, *x.shape[1:]), x.stride()


def _set_data(x: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``x.data = new``: torch keeps ``x``'s in-place version (no counter sees it)."""
    version = x._version
    x.data = new
    assert x._version == version
    return x


# how each kind of tensor is changed: in place (resize_, as_strided_, set_), by ``.data =`` at the same
# address (another layout, or another dtype), or freed and replaced ("recycled": often the same address)
CHANGES = {
    "meta-2d": {  # block_tables [B, W]: one column less, or rows read with the old stride
        "resize_": lambda x: x.resize_(x.shape[0], x.shape[1] - 1),
        "as_strided_": lambda x: x.as_strided_((x.shape[0], x.shape[1] - 1), x.stride()),
        "set_": lambda x: x.set_(x.clone()),
        "data=": lambda x: _set_data(x, x.view(-1)[: x.numel() - x.shape[0]].view(x.shape[0], -1)),
        "data=dtype": lambda x: _set_data(x, x.view(torch.float32)),
        "recycled": lambda shape, dtype: torch.zeros(shape[::-1], dtype=dtype).t(),  # column-major
    },
    "meta-1d": {  # cu_seqlens_q [B + 1], the error flag [8]
        "resize_": lambda x: x.resize_(x.shape[0] - 1),
        "as_strided_": lambda x: x.as_strided_((x.shape[0] - 1,), (1,)),
        "set_": lambda x: x.set_(x.clone()),
        "data=": lambda x: _set_data(x, x[:-1]),
        "data=dtype": lambda x: _set_data(x, x.view(torch.float32)),
        "recycled": lambda shape, dtype: torch.zeros(shape, dtype=dtype),
    },
    "rows": {  # q / k / out [T, H, D] (from _wide): the same shape, rows twice as far apart
        "as_strided_": lambda x: x.as_strided_(*_wider_rows(x)),
        "set_": lambda x: x.set_(x.clone()),
        "data=": lambda x: _set_data(x, x.as_strided(*_wider_rows(x))),
        "recycled": lambda shape, dtype: torch.zeros(shape, dtype=dtype),
    },
    "cache": {  # [NB, Hkv, BS, D]: a block less (fewer pages), or the same layout elsewhere
        "resize_": lambda x: x.resize_(*_narrower(x)[0]),
        "as_strided_": lambda x: x.as_strided_(*_narrower(x)),
        "set_": lambda x: x.set_(x.clone()),
        "data=": lambda x: _set_data(x, x[:-1]),
        "recycled": lambda shape, dtype: torch.zeros(shape, dtype=dtype),
    },
}


# what a launch reads of these tensors: batch ids by address and dtype; the error flag by address only
# (an ``int32 [8]`` by contract, ``kernels/errors.py``: its dtype is in no kernel key, as before the lane)
READ_ONLY = {"bid": ("ptr", "dtype"), "errors": ("ptr",)}


def _apply(t: dict, what: str, kind: str, how: str) -> bool:
    """Change ``t[what]`` as ``CHANGES[kind][how]``; whether the change may leave every launch as it was
    (a recycled tensor of the same layout at the same address; a new shape of a tensor read by address
    and dtype only)."""
    old = t[what]
    ptr, shape, strides, dtype = old.data_ptr(), old.shape, old.stride(), old.dtype
    change = CHANGES[kind][how]
    if how != "recycled":
        t[what] = new = change(old)
    else:
        del old
        t[what] = None  # the last reference: freed
        t[what] = new = change(shape, dtype)
    read = READ_ONLY.get(what, ("ptr", "dtype", "layout"))
    return (
        ("ptr" not in read or new.data_ptr() == ptr)
        and ("dtype" not in read or new.dtype == dtype)
        and ("layout" not in read or (new.shape, new.stride()) == (shape, strides))
    )


ATTEND_CHANGES = [
    (what, kind, how)
    for what, kind in (
        ("table", "meta-2d"),
        ("cu", "meta-1d"),
        ("errors", "meta-1d"),
        ("q", "rows"),
        ("out", "rows"),
        ("key_cache", "cache"),
    )  # fmt: skip
    for how in CHANGES[kind]
]


@pytest.mark.parametrize(
    ("what", "kind", "how"), ATTEND_CHANGES, ids=[f"{w}-{h}" for w, _, h in ATTEND_CHANGES]
)
def test_attention_lane_after_a_tensor_changed_in_place(kept, what, kind, how):
    """Call, change one tensor, call again: the second call launches what a fresh plan launches for the
    changed tensors (caches of another layout get another plan from the memo; the step's sizes,
    strides, dtypes and addresses, q's and out's, are read again)."""
    s = make_step(STEPS["mixed"], **SMALL)
    t = {
        "q": _wide(s.q), "key_cache": s.key_cache.clone(), "value_cache": s.value_cache.clone(),
        "cu": s.cu.clone(), "dec": s.dec.clone(), "table": s.table.clone(),
        "errors": torch.zeros(8, dtype=torch.int32), "out": _wide(torch.zeros(*s.q.shape[:2], 16)),
    }  # fmt: skip
    del s

    def call():
        return pa.paged_attention(
            t["q"], t["key_cache"], t["value_cache"], t["cu"], t["dec"], t["table"], scale=0.25, max_q_len=4,
            out=t["out"], errors=t["errors"],
        )  # fmt: skip

    _, first = _recorded(call)
    may_repeat = _apply(t, what, kind, how)
    res, got = _recorded(call)
    _, want = _reference_attend(
        t["q"], t["key_cache"], t["value_cache"], t["cu"], t["dec"], t["table"], out=t["out"],
        errors=t["errors"], mq=4, mc=None, scale=0.25,
    )  # fmt: skip
    _assert_same_launches(got, want, res, True, False)
    assert may_repeat or got != first  # the change reached the kernels' arguments or keys
    assert kept["attend"] == 0


WRITE_CHANGES = [
    (what, kind, how)
    for what, kind in (("table", "meta-2d"), ("bid", "meta-1d"), ("k", "rows"), ("key_cache", "cache"))
    for how in CHANGES[kind]
]


@pytest.mark.parametrize(
    ("what", "kind", "how"), WRITE_CHANGES, ids=[f"{w}-{h}" for w, _, h in WRITE_CHANGES]
)
def test_write_lane_after_a_tensor_changed_in_place(kept, what, kind, how):
    s = make_step(STEPS["mixed"], **SMALL)
    t = {
        "k": _wide(s.k), "v": s.v.clone(), "key_cache": s.key_cache.clone(),
        "value_cache": s.value_cache.clone(), "bid": s.bid.clone(), "cu": s.cu.clone(), "dec": s.dec.clone(),
        "table": s.table.clone(),
    }  # fmt: skip
    del s

    def call():
        return cw.write_kv_cache(
            t["k"], t["v"], t["key_cache"], t["value_cache"], t["bid"], t["cu"], t["dec"], t["table"]
        )

    _, first = _recorded(call)
    may_repeat = _apply(t, what, kind, how)
    _, got = _recorded(call)
    plan = cw.CacheWritePlan(t["key_cache"], t["value_cache"])
    step = LaunchStep(t["cu"], t["dec"], t["table"], t["bid"])
    _, want = _recorded(lambda: plan.run_step(t["k"], t["v"], step))
    assert len(got) == 1 and got == want
    assert may_repeat or got != first
    assert kept["write"] == 0


def test_hopper_lane_launches_tritons_arguments_by_address(kept, monkeypatch):
    """A prefill one-shot on the Hopper kernel (forced: these are CPU tensors): its kept launch passes
    what the Hopper plan's Triton path passes for the same tensors, tensors as their addresses (the value
    cache's row stride included, read once per plan)."""
    from fastdeploy_paddlefleet.kernels import hopper_prefill as hpm

    if not hpm.gluon_available():
        pytest.skip("needs triton.experimental.gluon (descriptors)")
    monkeypatch.setattr(pa, "choose_prefill_impl", lambda *args: "hopper")
    monkeypatch.setattr(hpm, "_num_sms", lambda device: 4)
    s = make_step(
        STEPS["prefill"], hkv=2, group=2, dqk=64, dv=64, block_size=16, dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )  # fmt: skip
    kc = s.key_cache.clone()
    vc = torch.zeros(*s.value_cache.shape[:3], 128, dtype=torch.bfloat16)[..., :64]  # wider rows than kc's
    vc.copy_(s.value_cache)
    flag = torch.zeros(8, dtype=torch.int32)
    out = torch.empty(s.q.shape[0], s.q.shape[1], 64, dtype=torch.bfloat16)
    for _ in range(3):  # builds the memo's plan (its Hopper plan on the first prefill), then finds it
        res, got = _recorded(
            lambda: pa.paged_attention(
                s.q, kc, vc, s.cu, s.dec, s.table, scale=0.25, max_q_len=8, out=out, errors=flag
            )
        )
    # the fast launch and the safe one (hopper_prefill.py, "Masked keys")
    assert res is out and [c[0][0] for c in got] == ["hopper", "hopper-safe"] and got[0][3] == STREAM

    class TritonPath:  # a kernel cache with nothing kept: records Triton's launch
        addresses = True
        calls: list = []

        def kernel(self, key):
            return None

        def launch(self, fn, key, grid, args, consts, stream):
            self.calls.append((grid, tuple(_snapshot(a) for a in args), stream))

    plan = hpm.HopperPlan(
        kc, vc, s.q.shape[1], None, qk_scale=0.25 * pa.LOG2E, sink_mode=0, headwise=False, has_window=False,
        window=0, win_h0=0, win_h1=2,
    )  # fmt: skip
    ref = TritonPath()
    plan.run(s.q, out, s.cu, s.dec, s.table, flag, ref, None, STREAM, None)
    assert len(ref.calls) == 2 and ref.calls[0] == ref.calls[1]  # both launches take the same arguments
    grid, args, stream = ref.calls[0]
    redo = 10  # each plan's own flags (the one-shot memo's plan is another plan)
    want = tuple(
        None if i == redo else a.data_ptr() if isinstance(a, torch.Tensor) else a for i, a in enumerate(args)
    )
    for _, g, a, st in got:
        assert (g, tuple(None if i == redo else x for i, x in enumerate(a)), st) == (grid, want, stream)
    assert want[15] == vc.stride(2) == 128 and want[3][1] == kc.data_ptr() and want[4][1] == vc.data_ptr()
