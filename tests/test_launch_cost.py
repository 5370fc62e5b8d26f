"""Host cost per launch (issue 20): launch plans, per-step state, direct launches of compiled kernels,
the one-shot wrappers' plan memo.

CPU cases check the bookkeeping with fakes (which launch goes through Triton, which one is direct, with
which arguments: a direct launch passes the addresses of the tensors Triton's path was given), that the
backend derives per-layer plans once and per-step metadata once per step, and that the one-shot
wrappers reuse a plan only while nothing it derives from changed (dense reference). GPU cases (``gpu``)
check that direct launches compute exactly what Triton's own launch path computes (bitwise, on fresh
metadata every step, misaligned views included, addresses or tensors). Host time per call is a
benchmark's figure (``benchmarks/attention.py --cases host``, ``probes/launch_parts.py --wrappers``),
not a test.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from test_triton_kernels import CUDA, REAL, _layer, _meta, make_step  # noqa: E402

from fastdeploy_paddlefleet.backends.triton import TritonBackend  # noqa: E402
from fastdeploy_paddlefleet.kernels.cache_write import write_kv_cache  # noqa: E402
from fastdeploy_paddlefleet.kernels.dense_reference import dense_attention  # noqa: E402
from fastdeploy_paddlefleet.kernels.launch.direct import KernelCache  # noqa: E402
from fastdeploy_paddlefleet.kernels.paged_attention import paged_attention  # noqa: E402

#: the first variant of each parametrized GPU test stays in ``-m gpu`` (conftest.py), the rest run with
#: ``-m gpu_long`` (each compiles its own kernels: -m gpu stays under 5 minutes)
GPU_LONG_VARIANTS = True

gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@pytest.fixture
def direct_launch(monkeypatch):
    """Direct launches on (opt-in, ``kernels/launch/direct.py``): plans built inside the test use them."""
    from fastdeploy_paddlefleet.kernels.launch import direct as _launch

    monkeypatch.setattr(_launch, "DIRECT_LAUNCH", True)


class _FakeParam:
    def __init__(self, default):
        self.default = default


class _FakeCompiled:
    packed_metadata = "meta"
    function = "fn-handle"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class _FakeJit:
    """Stands in for a @triton.jit function: ``fn[grid](*args, **consts)`` compiles (counted)."""

    arg_names = ["A", "B", "C", "N", "M"]
    params = [_FakeParam(None)] * 3 + [_FakeParam(None), _FakeParam(7)]

    def __init__(self):
        self.slow_calls = []
        self.compiled = _FakeCompiled()

    def __getitem__(self, grid):
        def call(*args, **consts):
            self.slow_calls.append((grid, args, consts))
            return self.compiled

        return call


def test_kernel_cache_goes_direct_after_the_first_call_per_key():
    fn = _FakeJit()
    cache = KernelCache(0)
    cache.direct = True  # as on a GPU without launch hooks
    cache.launch(fn, "k1", (4,), (1, 2, 3), {"N": 16, "num_warps": 4}, stream=11)
    assert len(fn.slow_calls) == 1 and len(cache) == 1
    cache.launch(fn, "k1", (5, 2), (10, 20, 30), {"N": 16, "num_warps": 4}, stream=12)
    assert len(fn.slow_calls) == 1  # direct: the compiled kernel's launcher
    (run,) = fn.compiled.runs
    # grid padded to 3-D, stream, handle, metadata, no hooks, every parameter in order (defaults too)
    assert run == (5, 2, 1, 12, "fn-handle", "meta", None, None, None, 10, 20, 30, 16, 7)
    cache.launch(fn, "k2", (1,), (1, 2, 3), {"N": 32}, stream=12)  # a new key: Triton's path again
    cache.launch(fn, None, (1,), (1, 2, 3), {"N": 32}, stream=12)  # no key (e.g. misaligned): never cached
    cache.launch(fn, None, (1,), (1, 2, 3), {"N": 32}, stream=12)
    assert len(fn.slow_calls) == 4 and len(cache) == 2


def test_empty_triton_hook_chains_count_as_no_hooks():
    """Triton 3.6 keeps its launch hooks as an (empty) ``HookChain``, never ``None``."""
    from fastdeploy_paddlefleet.kernels.launch.direct import _no_hooks

    class Chain:
        def __init__(self, calls):
            self.calls = calls

    assert _no_hooks(None) and _no_hooks(Chain([]))
    assert not _no_hooks(Chain([print])) and not _no_hooks(print)


def test_kernel_cache_off_the_gpu_always_takes_tritons_path():
    fn = _FakeJit()
    cache = KernelCache(None)
    assert not cache.direct
    for _ in range(3):
        cache.launch(fn, "k", (1,), (1, 2, 3), {"N": 16}, stream=None)
    assert len(fn.slow_calls) == 3 and not fn.compiled.runs and len(cache) == 0


def test_backend_derives_plans_per_layer_and_metadata_per_step(monkeypatch):
    """Two layers over three steps: two plans (built on the first step), one step state per step shared
    by both layers, every output equal to the one-shot kernels' output."""
    from fastdeploy_paddlefleet.backends import triton as tb

    backend = TritonBackend(validate=False, host_checks=False)
    built, states = [], []
    new_plan, new_state = TritonBackend._new_plan, tb._StepState.__init__

    def counting_plan(self, *a, **kw):
        built.append(1)
        return new_plan(self, *a, **kw)

    def counting_state(self, *a, **kw):
        states.append(1)
        new_state(self, *a, **kw)

    monkeypatch.setattr(TritonBackend, "_new_plan", counting_plan)
    monkeypatch.setattr(tb._StepState, "__init__", counting_state)
    layers = [_layer(2, 2, 16, 16), _layer(2, 2, 16, 16, kind="sliding", window=5, sink="off-by-one")]
    layers[1] = type(layers[1])(**{**layers[1].__dict__, "index": 4})
    reqs = [(9, 4), (20, 1), (3, 1)]  # same shapes every step: fresh contents, tables and queries
    persistent = {}
    for seed in range(3):
        s = make_step(reqs, hkv=2, group=2, dqk=16, dv=16, block_size=8, seed=seed)
        meta = _meta(s, 8)
        for layer in layers:
            kc, vc = persistent.setdefault(layer.index, (s.key_cache.clone(), s.value_cache.clone()))
            kc.copy_(s.key_cache)  # the serving caches keep their tensors; contents change
            vc.copy_(s.value_cache)
            out = backend.forward(s.q, s.k, s.v, layer, meta, (kc, vc))
            ref_kc, ref_vc = s.key_cache.clone(), s.value_cache.clone()
            write_kv_cache(s.k, s.v, ref_kc, ref_vc, s.bid, s.cu, s.dec, s.table)
            slides = layer.window_left is not None
            want = paged_attention(
                s.q, ref_kc, ref_vc, s.cu, s.dec, s.table, scale=layer.softmax_scale,
                window_left=layer.window_left if slides else None, sink_kind=layer.sink,
                max_q_len=meta.max_seq_len_this_time, max_context_len=meta.max_context_len,
            )  # fmt: skip
            torch.testing.assert_close(out, want.view(want.shape[0], -1), rtol=0, atol=0)
            assert torch.equal(kc.nan_to_num(7.0), ref_kc.nan_to_num(7.0))
    assert len(built) == 2  # one plan per layer, built on the first step
    assert len(states) == 3  # one step state per step, shared by both layers


def test_plan_is_rebuilt_when_sinks_change_in_place():
    backend = TritonBackend(validate=False, host_checks=False)
    layer = _layer(2, 2, 16, 16, sink="learnable")
    s = make_step([(9, 4), (20, 1)], hkv=2, group=2, dqk=16, dv=16, block_size=8)
    sinks = torch.zeros(4, device=s.q.device)
    meta = _meta(s, 8)
    kv = (s.key_cache, s.value_cache)
    out0 = backend.forward(s.q, s.k, s.v, layer, meta, kv, sinks).clone()
    sinks.add_(3.0)  # weights reloaded into the same tensor
    out1 = backend.forward(s.q, s.k, s.v, layer, meta, kv, sinks)
    want = paged_attention(
        s.q, *kv, s.cu, s.dec, s.table, scale=layer.softmax_scale, sink_kind="learnable", sinks=sinks,
        max_q_len=4, max_context_len=21,
    )  # fmt: skip
    torch.testing.assert_close(out1, want.view(5, -1), rtol=0, atol=0)
    assert not torch.equal(out0, out1)


class _CudaLike(torch.Tensor):
    """A CPU tensor that says it is on a GPU: lets the plans take their direct path with fake kernels."""

    @property
    def is_cuda(self):
        return True


class _NoIsCuda:
    """A tensor stand-in without ``is_cuda`` (a paddle tensor may lack it): everything else read through."""

    def __init__(self, x):
        self._x = x

    def __getattr__(self, name):
        if name == "is_cuda":
            raise AttributeError(name)
        return getattr(self._x, name)


@pytest.mark.parametrize("build", ["class", "fill_step"])
@pytest.mark.parametrize("where", ["gpu", "cpu", "no-is_cuda-table", "no-is_cuda-bid", "misaligned-bid"])
def test_launch_step_derives_what_the_launches_read(build, where):
    """``LaunchStep(...)`` and ``fill_step(new_step(), ...)`` (the one-shot wrappers' constructor, by
    position) give the step's sizes, addresses and dtypes as read from the tensors, and allow direct
    launches only when every tensor says it is on a GPU (a missing ``is_cuda`` counts as not) and every
    address is 16-byte aligned."""
    from fastdeploy_paddlefleet.kernels.launch import direct as _launch

    s = make_step([(9, 4), (20, 1), (3, 2)], **SMALL)
    gpu_like = where != "cpu"

    def wrap(x):  # CPU tensors on any machine: "cpu" is read as off the GPU, the others as on it
        x = x.cpu()
        return x.as_subclass(_CudaLike) if gpu_like else x

    cu, dec, table, flag = wrap(s.cu), wrap(s.dec), wrap(s.table), wrap(torch.zeros(8, dtype=torch.int32))
    bid = wrap(s.bid)
    if where == "no-is_cuda-table":
        table = _NoIsCuda(table)
    elif where == "no-is_cuda-bid":
        bid = _NoIsCuda(bid)
    elif where == "misaligned-bid":
        bid = wrap(torch.zeros(s.bid.numel() + 1, dtype=s.bid.dtype)[1:])
    for b, errors in ((bid, flag), (None, None)):
        if build == "class":
            step = _launch.LaunchStep(cu, dec, table, b, max_q_len=4, max_context_len=21, errors=errors)
        else:
            step = _launch.fill_step(_launch.new_step(), cu, dec, table, b, 4, 21, errors)
        err = flag if errors is not None else table
        assert (step.cu, step.dec, step.table, step.bid, step.errors, step.err_arg) == (
            cu, dec, table, b, errors, err
        )  # fmt: skip
        assert (step.max_q_len, step.max_context_len) == (4, 21)
        assert (step.num_reqs, step.n_blk, step.stride_tbl) == (3, s.table.shape[1], s.table.shape[1])
        assert step.ptrs == (cu.data_ptr(), dec.data_ptr(), table.data_ptr(), err.data_ptr())
        assert step.bid_ptr == (0 if b is None else b.data_ptr())
        bid_dtype = None if b is None else b.dtype
        assert step.sig == (torch.int32, torch.int32, torch.int32, bid_dtype, errors is not None)
        direct = where == "gpu" or (b is None and where in ("no-is_cuda-bid", "misaligned-bid"))
        assert step.direct_ok is direct, (where, b is None)
    with pytest.raises(ValueError, match="block_tables must be 2-D"):
        if build == "class":
            _launch.LaunchStep(cu, dec, s.table[0])
        else:
            _launch.fill_step(_launch.new_step(), cu, dec, s.table[0], None, None, None, None)


class _RecordingJit:
    """Stands in for one of the plans' kernels: the real parameter list; records Triton's path (args as
    given) and the direct path (the compiled launcher's args)."""

    def __init__(self, real):
        import inspect

        sig = inspect.signature(getattr(real, "fn", real))
        self.arg_names = list(sig.parameters)
        self.params = [
            _FakeParam(None if p.default is p.empty else p.default) for p in sig.parameters.values()
        ]
        self.triton_calls, self.direct_calls = [], []
        jit = self

        class Compiled:
            packed_metadata, function = "meta", "fn-handle"

            def run(self, *a):
                jit.direct_calls.append(a[9 : 9 + jit.n_args])

        self.compiled = Compiled()

    def __getitem__(self, grid):
        def call(*args, **consts):
            self.n_args = len(args)
            self.triton_calls.append(args)
            return self.compiled

        return call


@pytest.mark.parametrize("kind", ["decode", "prefill", "write", "decode-fp8", "prefill-int8"])
def test_direct_launches_pass_the_addresses_of_tritons_arguments(monkeypatch, kind):
    """On the direct path every pointer argument is the address (an int) of the tensor Triton's path was
    given, every other argument the same value: the compiled launcher sees what Triton's would (a
    quantized cache's scales and their strides included)."""
    from fastdeploy_paddlefleet.kernels import cache_write as cw
    from fastdeploy_paddlefleet.kernels import paged_attention as pa
    from fastdeploy_paddlefleet.kernels.launch import direct as _launch

    monkeypatch.setattr(_launch.KernelCache, "stream", lambda self: 7)
    kind, _, quant = kind.partition("-")
    name = {"decode": "_decode_kernel", "prefill": "_prefill_kernel", "write": "_write_kv_kernel"}[kind]
    module = cw if kind == "write" else pa
    fake = _RecordingJit(getattr(module, name))
    monkeypatch.setattr(module, name, fake)
    reqs = [(9, 1), (20, 1)] if kind == "decode" else [(9, 4), (3, 4)]
    s = make_step(reqs, **SMALL)
    cuda = {n: getattr(s, n).as_subclass(_CudaLike) for n in ("q", "k", "v", "cu", "dec", "bid", "table")}
    sinks = torch.randn(s.q.shape[1])
    flag = torch.zeros(8, dtype=torch.int32).as_subclass(_CudaLike)
    step = _launch.LaunchStep(
        cuda["cu"], cuda["dec"], cuda["table"], cuda["bid"], max_q_len=reqs[0][1], errors=flag
    )
    if kind == "write":
        plan = cw.CacheWritePlan(s.key_cache, s.value_cache)
    else:
        caches, qkw = (s.key_cache, s.value_cache), {}
        if quant:  # uint8 codes; per-token scales (fp8) or per-channel ones (int8)
            caches = tuple(torch.zeros(c.shape, dtype=torch.uint8) for c in caches)
            if quant == "fp8":
                scales = [torch.ones(c.shape[:3]) for c in caches]
                qkw = dict(kv_quant="block_wise_fp8", key_scale=scales[0], value_scale=scales[1])
            else:
                qkw = dict(kv_quant="int8", key_scale=torch.ones(2 * 16), value_scale=torch.ones(2 * 16))
        plan = pa.AttentionPlan(
            *caches,
            s.q,
            scale=0.25,
            sink_kind="learnable",
            sinks=sinks,
            prefill_impl="portable",
            **qkw,
        )
    plan.kernels.direct = True  # as on a GPU without launch hooks
    for _ in range(3):
        if kind == "write":
            plan.run_step(cuda["k"], cuda["v"], step)
        else:
            out = torch.empty(s.q.shape[0], s.q.shape[1], 16).as_subclass(_CudaLike)
            plan.run_step(cuda["q"], step, out=out)
    # compiled once, then direct; the prefill launches twice a step (its fast and safe launches)
    launches = 2 if kind == "prefill" else 1
    assert len(fake.triton_calls) == launches and len(fake.direct_calls) == 2 * launches

    def address(a):
        return a.data_ptr() if isinstance(a, torch.Tensor) else a

    # each call's own output tensor (and the prefill's flags for its safe launch)
    fresh = {"write": (), "prefill": (3, 11)}.get(kind, (3,))
    want = [None if i in fresh else address(a) for i, a in enumerate(fake.triton_calls[0])]
    for got in fake.direct_calls:
        assert all(not isinstance(a, torch.Tensor) for a in got)  # no tensor reaches the launcher
        assert [None if i in fresh else a for i, a in enumerate(got)] == want


def test_served_checks_run_in_full_once_per_step_and_layer_setup(monkeypatch):
    """Served mode (validate, no host copy): validate_shapes runs on a step's first call and on a layer
    setup not seen before; later calls that match skip it, and any call that differs in what it reads
    (token count, head shapes, a new step's metadata) is checked in full and refused when bad."""
    from fastdeploy_paddlefleet.backends import checks

    calls = []
    real = checks.validate_shapes

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(checks, "validate_shapes", counting)
    monkeypatch.setattr(TritonBackend, "_run", lambda self, q, *a: q)  # the checks only
    backend = TritonBackend(validate=True, host_checks=False)
    layers = [_layer(2, 2, 16, 16), _layer(2, 2, 16, 16, kind="sliding", window=5)]
    layers[1] = type(layers[1])(**{**layers[1].__dict__, "index": 4})
    s = make_step(REQS, **SMALL)
    kv = (s.key_cache, s.value_cache)
    for _ in range(3):  # three steps: new metadata objects, same shapes
        meta = _meta(s, 8)
        for layer in layers:
            backend.forward(s.q, s.k, s.v, layer, meta, kv)
    assert len(calls) == 2 + 1 + 1  # both layers on the first step, then each step's first call
    meta = _meta(s, 8)
    backend.forward(s.q, s.k, s.v, layers[0], meta, kv)
    n = len(calls)
    with pytest.raises(ValueError, match="k.shape"):  # k of another token count
        backend.forward(s.q, s.k[:-1], s.v[:-1], layers[1], meta, kv)
    with pytest.raises(ValueError, match="k.shape"):  # k with other heads
        backend.forward(s.q, s.k[:, :1], s.v, layers[1], meta, kv)
    assert len(calls) == n + 2
    backend.forward(s.q, s.k, s.v, layers[1], meta, kv)  # matches what was checked: skipped
    assert len(calls) == n + 2
    bad = _meta(s, 8)
    bad.batch_id_per_token = s.bid[:-1]  # a new step whose metadata is wrong
    with pytest.raises(ValueError, match="batch_id_per_token"):
        backend.forward(s.q, s.k, s.v, layers[0], bad, kv)


# ------------------------------------------------------------------------------ one-shot plan memo


def _write_and_attend(s, **kw):
    """This step's K/V into its caches, then attention, both through the one-shot wrappers."""
    write_kv_cache(s.k, s.v, s.key_cache, s.value_cache, s.bid, s.cu, s.dec, s.table)
    return paged_attention(
        s.q, s.key_cache, s.value_cache, s.cu, s.dec, s.table, max_q_len=max(n for _, n in s.reqs), **kw
    )


def _assert_dense(s, out, *, scale, window_left=None, sink_kind="vanilla", sinks=None):
    """Every request's rows against the dense reference over its K/V history (in q's dtype)."""
    assert out.dtype == s.q.dtype
    for b, (_, n) in enumerate(s.reqs):
        lo, hi = int(s.cu[b]), int(s.cu[b] + n)
        want = dense_attention(
            s.q[lo:hi], s.hist_k[b], s.hist_v[b], scale=scale, window_left=window_left, sink_kind=sink_kind,
            sinks=sinks, compute_dtype=torch.float64,
        )  # fmt: skip
        got = out[lo:hi].to(torch.float64)
        err = float((got - want).norm() / want.norm().clamp_min(1e-6))
        assert err <= (1e-5 if s.q.dtype == torch.float32 else 3e-3), (b, err)


@pytest.fixture
def fresh_memos(monkeypatch):
    """Empty one-shot memos, and counters of the plans the wrappers build."""
    from fastdeploy_paddlefleet.kernels import cache_write as cw
    from fastdeploy_paddlefleet.kernels import paged_attention as pa
    from fastdeploy_paddlefleet.kernels.launch.direct import PlanMemo

    built = {"attend": 0, "write": 0}

    class CountingAttention(pa.AttentionPlan):
        def __init__(self, *a, **kw):
            built["attend"] += 1
            super().__init__(*a, **kw)

    class CountingWrite(cw.CacheWritePlan):
        def __init__(self, *a, **kw):
            built["write"] += 1
            super().__init__(*a, **kw)

    monkeypatch.setattr(pa, "_PLANS", PlanMemo())
    monkeypatch.setattr(cw, "_PLANS", PlanMemo())
    monkeypatch.setattr(pa, "AttentionPlan", CountingAttention)
    monkeypatch.setattr(cw, "CacheWritePlan", CountingWrite)
    return built


SMALL = dict(hkv=2, group=2, dqk=16, dv=16, block_size=8)
REQS = [(9, 4), (20, 1)]  # a prefill chunk over context and a decode token: both kernels


def test_one_shot_wrappers_reuse_their_plans(fresh_memos):
    """Eager calls with the same caches and arguments build one plan per wrapper; each call still reads
    its own step (new queries, tables and cache contents in the same tensors)."""
    s = make_step(REQS, seed=1, **SMALL)
    for seed in range(3):
        fresh = make_step(REQS, seed=seed + 2, **SMALL)
        s.key_cache.copy_(fresh.key_cache)  # same cache tensors, this step's contents
        s.value_cache.copy_(fresh.value_cache)
        fresh.key_cache, fresh.value_cache = s.key_cache, s.value_cache
        out = _write_and_attend(fresh, scale=0.25)
        _assert_dense(fresh, out, scale=0.25)
    assert fresh_memos == {"attend": 1, "write": 1}


def _wider_view(c):
    """``c`` as the leading heads of a cache twice as wide (another heads-per-block stride)."""
    wide = torch.full(
        (c.shape[0], 2 * c.shape[1], *c.shape[2:]), float("nan"), dtype=c.dtype, device=c.device
    )
    view = wide[:, : c.shape[1]]
    view.copy_(c)
    return view


@pytest.mark.parametrize("change", ["caches", "dtype", "strides", "window", "scale"])
def test_one_shot_plan_is_rebuilt_when_what_it_derives_from_changes(fresh_memos, change):
    """A second call that differs in one thing a plan derives from gets its own plan and its own right
    answer (a stale plan would write into / read the first caches, or use the first dtype, heads per
    block, window or scale); a third call like the second reuses the second's plan."""
    first = make_step(REQS, seed=1, **SMALL)
    kw1 = dict(scale=0.25)
    _assert_dense(first, _write_and_attend(first, **kw1), **kw1)
    kc_first = first.key_cache.clone()
    dtype = torch.float16 if change == "dtype" else torch.float32
    second = make_step(REQS, seed=7, dtype=dtype, **SMALL)
    if change == "strides":
        second.key_cache, second.value_cache = _wider_view(second.key_cache), _wider_view(second.value_cache)
    elif change in ("window", "scale"):  # the first step's cache tensors, the second step's contents
        first.key_cache.copy_(second.key_cache)
        first.value_cache.copy_(second.value_cache)
        second.key_cache, second.value_cache = first.key_cache, first.value_cache
    kw2 = {"window": dict(scale=0.25, window_left=3), "scale": dict(scale=0.5)}.get(change, kw1)
    for _ in range(2):
        _assert_dense(second, _write_and_attend(second, **kw2), **kw2)
    new_caches = change in ("caches", "dtype", "strides")
    if new_caches:  # no write went to the first step's caches
        assert torch.equal(first.key_cache.nan_to_num(7.0), kc_first.nan_to_num(7.0))
    assert fresh_memos == {"attend": 2, "write": 2 if new_caches else 1}


def test_caches_on_another_device_than_q_are_refused_by_name():
    """Triton's own refusal ("Pointer argument (at 2) cannot be accessed ... (cpu tensor?)") names no
    tensor: the plan names the cache and both devices (meta tensors stand in for a second device)."""
    s = make_step(REQS, seed=1, **SMALL)
    other = torch.empty(s.key_cache.shape, dtype=s.key_cache.dtype, device="meta")
    with pytest.raises(ValueError, match="value_cache is on meta but q is on"):
        paged_attention(s.q, s.key_cache, other, s.cu, s.dec, s.table, scale=0.25)
    with pytest.raises(ValueError, match="key_cache is on .* but value_cache on meta"):
        write_kv_cache(s.k, s.v, s.key_cache, other, s.bid, s.cu, s.dec, s.table)


@pytest.mark.parametrize("sinks_dtype", [torch.float32, torch.float16])
def test_one_shot_plan_is_rebuilt_when_sinks_change_in_place(fresh_memos, sinks_dtype):
    """float16 sinks: the plan holds a float32 copy, so an in-place change must give a new plan."""
    s = make_step(REQS, seed=3, **SMALL)
    write_kv_cache(s.k, s.v, s.key_cache, s.value_cache, s.bid, s.cu, s.dec, s.table)
    sinks = torch.linspace(-1, 1, s.q.shape[1]).to(sinks_dtype)
    kw = dict(scale=0.25, sink_kind="learnable", max_q_len=4)
    for _ in range(2):
        out = paged_attention(s.q, s.key_cache, s.value_cache, s.cu, s.dec, s.table, sinks=sinks, **kw)
        sinks.add_(2.0)  # weights reloaded into the same tensor
    out = paged_attention(s.q, s.key_cache, s.value_cache, s.cu, s.dec, s.table, sinks=sinks, **kw)
    _assert_dense(s, out, scale=0.25, sink_kind="learnable", sinks=sinks.float())
    assert fresh_memos["attend"] == 3


def test_one_shot_plan_follows_the_module_settings(fresh_memos, monkeypatch):
    """A plan reads ERR_LOOP_* (how a kernel finds bad table entries) when it first launches: flipping
    them gives a new plan, whose kernels still give the dense reference's answer."""
    from fastdeploy_paddlefleet.kernels import paged_attention as pa
    from fastdeploy_paddlefleet.kernels.errors import new_error_flag

    s = make_step(REQS, seed=6, **SMALL)
    write_kv_cache(s.k, s.v, s.key_cache, s.value_cache, s.bid, s.cu, s.dec, s.table)
    flag = new_error_flag(s.q)
    consts = []
    for in_loop in (False, True, True):
        monkeypatch.setattr(pa, "ERR_LOOP_PREFILL", in_loop)
        monkeypatch.setattr(pa, "ERR_LOOP_DECODE", in_loop)
        out = paged_attention(
            s.q, s.key_cache, s.value_cache, s.cu, s.dec, s.table, scale=0.25, max_q_len=4, errors=flag
        )
        _assert_dense(s, out, scale=0.25)
        plan = pa._PLANS.plans()[-1]  # the most recent
        consts.append({k: c["ERR_LOOP"] for k, c in plan._consts.items()})
    assert fresh_memos["attend"] == 2
    assert all(v is False for v in consts[0].values()) and all(v is True for v in consts[1].values())


def test_one_shot_memo_keeps_no_cache_alive(fresh_memos):
    """The memo drops its plans' caches after each call: freeing the caller's caches frees them."""
    import gc
    import weakref

    from fastdeploy_paddlefleet.kernels import paged_attention as pa

    s = make_step(REQS, seed=4, **SMALL)
    _write_and_attend(s, scale=0.25)
    refs = [weakref.ref(s.key_cache), weakref.ref(s.value_cache)]
    del s
    gc.collect()
    assert all(r() is None for r in refs)
    assert len(pa._PLANS) == 1


def test_bind_moves_every_cache_reference_of_a_plan():
    """bind() points the plan and its Hopper plan's TMA descriptors at the given caches (or at none:
    a memoised plan keeps no cache alive); a Hopper plan it cannot rebind is dropped (built again)."""
    from types import SimpleNamespace

    from fastdeploy_paddlefleet.kernels import paged_attention as pa

    s = make_step(REQS, seed=5, **SMALL)
    plan = pa.AttentionPlan(s.key_cache, s.value_cache, s.q, scale=0.25)
    desc = SimpleNamespace(base=s.key_cache), SimpleNamespace(base=s.value_cache)
    plan.hopper = SimpleNamespace(value_cache=s.value_cache, k_desc=desc[0], v_desc=desc[1])
    plan.bind(None, None)
    assert (
        plan.key_cache is plan.value_cache is plan.hopper.value_cache is desc[0].base is desc[1].base is None
    )
    plan.bind(s.key_cache, s.value_cache)
    assert plan.key_cache is s.key_cache and plan.value_cache is s.value_cache
    assert (
        desc[0].base is s.key_cache
        and desc[1].base is s.value_cache
        and plan.hopper.value_cache is s.value_cache
    )
    plan.hopper = SimpleNamespace()  # no descriptors where bind() looks
    plan.bind(None, None)
    assert plan.hopper is None and plan.key_cache is None


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fused", [False, True], ids=["write-launch", "fused-write"])
@pytest.mark.parametrize("address_args", [True, False])
@pytest.mark.parametrize("kind", ["decode", "mixed", "headwise-window"])
def test_gpu_direct_launches_equal_tritons_path(kind, address_args, fused, direct_launch, monkeypatch):
    """Several steps through one backend (plans and direct launches after the first) against the
    one-shot wrappers run through Triton's own launch path on copies of the same caches: bitwise
    equal, whether the direct launches pass addresses or tensors."""
    from fastdeploy_paddlefleet.kernels.launch import direct as _launch

    monkeypatch.setattr(_launch, "ADDRESS_ARGS", address_args)
    monkeypatch.setenv("FDFLEET_FUSED_DECODE_WRITE", "1" if fused else "0")
    backend = TritonBackend(validate=False, host_checks=False)
    hkv = REAL["hkv"]
    if kind == "headwise-window":
        layer = _layer(hkv, 4, 128, 128, kind="headwise", window=100, sliding=(4, 8), sink="learnable")
    else:
        layer = _layer(hkv, 4, 128, 128)
    sinks = torch.randn(hkv * 4, device="cuda") if layer.sink == "learnable" else None
    big_k = torch.empty(80, hkv, REAL["block_size"], 128, dtype=torch.bfloat16, device="cuda")
    big_v = torch.empty_like(big_k)
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        ctx = torch.randint(1, 600, (6,), generator=gen).tolist()
        reqs = (
            [(c, 1) for c in ctx]
            if kind == "decode"
            else [(c, 1 if i % 2 else 37) for i, c in enumerate(ctx)]
        )
        headwise = kind == "headwise-window"
        s = make_step(
            reqs, dtype=torch.bfloat16, seed=seed, headwise=headwise, window_left=100 if headwise else None,
            sliding_heads=(4, 8) if headwise else None, release=headwise, **REAL,
        )  # fmt: skip
        meta = _meta(s, REAL["block_size"])
        nb = s.key_cache.shape[0]
        assert nb <= big_k.shape[0]
        big_k.fill_(float("nan"))
        big_v.fill_(float("nan"))
        big_k[:nb].copy_(s.key_cache)  # the serving caches keep their tensors; contents change
        big_v[:nb].copy_(s.value_cache)
        kc, vc = big_k.clone(), big_v.clone()
        out = backend.forward(s.q, s.k, s.v, layer, meta, (big_k, big_v), sinks)
        plan_fused = next(iter(backend._plans.values())).attend.fuse_write
        monkeypatch.setattr(_launch, "DIRECT_LAUNCH", False)  # the references: Triton's path every call
        # a decode-only step may write its K/V inside the decode launch (FDFLEET_FUSED_DECODE_WRITE)
        fused = plan_fused and meta.max_seq_len_this_time == 1
        if not fused:
            write_kv_cache(s.k, s.v, kc, vc, s.bid, s.cu, s.dec, s.table, headwise=headwise)
        slides = layer.window_left is not None
        want = paged_attention(
            s.q, kc, vc, s.cu, s.dec, s.table, scale=layer.softmax_scale, headwise=headwise,
            window_left=layer.window_left if slides else None,
            sliding_heads=layer.sliding_kv_heads if slides else None, sink_kind=layer.sink, sinks=sinks,
            max_q_len=meta.max_seq_len_this_time, max_context_len=meta.max_context_len,
            new_kv=(s.k, s.v) if fused else None,
        )  # fmt: skip
        monkeypatch.setattr(_launch, "DIRECT_LAUNCH", True)
        torch.cuda.synchronize()
        assert torch.equal(out, want.view(want.shape[0], -1)), (kind, seed)
        assert torch.equal(big_k.nan_to_num(7.0), kc.nan_to_num(7.0))
    plans = list(backend._plans.values())
    assert len(plans) == 1 and len(plans[0].attend.kernels) >= 1
    assert len(plans[0].write.kernels) == (0 if kind == "decode" and plan_fused else 1)


@pytest.mark.gpu
@gpu
def test_gpu_misaligned_views_take_tritons_path_and_stay_right(direct_launch):
    """q / k / v that start 2 bytes past a 16-byte boundary: Triton specialises on alignment, so these
    calls must not reuse a kernel compiled for aligned pointers."""
    backend = TritonBackend(validate=False, host_checks=False)
    layer = _layer(8, 4, 128, 128)
    reqs = [(100, 1), (300, 20), (7, 1)]
    s = make_step(reqs, dtype=torch.bfloat16, seed=5, **REAL)
    meta = _meta(s, REAL["block_size"])
    backend.forward(s.q, s.k, s.v, layer, meta, (s.key_cache, s.value_cache))  # aligned: compiles, caches
    direct = len(next(iter(backend._plans.values())).attend.kernels)
    s2 = make_step(reqs, dtype=torch.bfloat16, seed=6, **REAL)
    shifted = []
    for x in (s2.q, s2.k, s2.v):
        buf = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
        view = buf[1:].view(x.shape)
        view.copy_(x)
        shifted.append(view)
    assert shifted[0].data_ptr() % 16 == 2
    # same cache tensors (the plan keeps them), s2's contents: s2's table points at s2's pages
    s.key_cache.copy_(s2.key_cache)
    s.value_cache.copy_(s2.value_cache)
    kc, vc = s.key_cache.clone(), s.value_cache.clone()
    out = backend.forward(*shifted, layer, _meta(s2, REAL["block_size"]), (s.key_cache, s.value_cache))
    write_kv_cache(s2.k, s2.v, kc, vc, s2.bid, s2.cu, s2.dec, s2.table)
    want = paged_attention(
        s2.q, kc, vc, s2.cu, s2.dec, s2.table, scale=layer.softmax_scale, max_q_len=20, max_context_len=320
    )
    torch.cuda.synchronize()
    # Triton compiles another kernel for unaligned pointers: equal up to bf16 rounding, not bitwise
    torch.testing.assert_close(out, want.view(want.shape[0], -1))
    plan = next(iter(backend._plans.values()))
    assert len(plan.attend.kernels) == direct  # the unaligned call's kernels are not kept for direct use


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_gpu_one_shot_wrappers_reuse_their_plan_and_launch_directly(kind, direct_launch):
    """Eager one-shot calls with the same caches: one memoised plan per wrapper whose kernels launch
    directly after the first call; every call bitwise equal to Triton's own path (a plan that keeps no
    kernels), with fresh step contents in the same tensors."""
    from fastdeploy_paddlefleet.kernels import cache_write as cw
    from fastdeploy_paddlefleet.kernels import paged_attention as pa

    pa._PLANS.clear()
    cw._PLANS.clear()
    reqs = [(300, 1), (40, 1), (7, 1)] if kind == "decode" else [(300, 33), (0, 64)]
    base = make_step(reqs, dtype=torch.bfloat16, seed=1, **REAL)
    kc, vc = base.key_cache, base.value_cache
    max_q = max(n for _, n in reqs)
    for seed in range(3):
        s = make_step(reqs, dtype=torch.bfloat16, seed=seed + 2, **REAL)
        kc.copy_(s.key_cache)
        vc.copy_(s.value_cache)
        ref_k, ref_v = kc.clone(), vc.clone()
        write_kv_cache(s.k, s.v, kc, vc, s.bid, s.cu, s.dec, s.table)
        got = paged_attention(s.q, kc, vc, s.cu, s.dec, s.table, scale=0.1, max_q_len=max_q)
        ref_w = cw.CacheWritePlan(ref_k, ref_v, cached=False)
        ref_w.run(s.k, s.v, s.bid, s.cu, s.dec, s.table)
        ref = pa.AttentionPlan(ref_k, ref_v, s.q, scale=0.1, cached=False)
        want = ref.run(s.q, s.cu, s.dec, s.table, max_q_len=max_q)
        torch.cuda.synchronize()
        assert torch.equal(kc.nan_to_num(7.0), ref_k.nan_to_num(7.0)), seed
        assert torch.equal(got, want), seed
    assert len(pa._PLANS) == 1 and len(cw._PLANS) == 1
    (plan,) = pa._PLANS.plans()
    assert len(plan.kernels) >= 1 and plan.key_cache is None  # direct kernels kept, no cache held


def test_plan_memo_takes_gives_and_drops_the_least_recently_taken():
    """One plan per key out at a time; a plan goes back to its slot; past ``size`` keys the least
    recently taken is dropped, also when it was the last key taken (its slot then no longer serves)."""
    from fastdeploy_paddlefleet.kernels.launch.direct import PlanMemo

    memo = PlanMemo(size=2)
    assert memo.take(("a",)) == (None, None)
    memo.give(("a",), "plan-a", keep="sinks-a")
    plan, slot = memo.take(("a",))
    assert plan == "plan-a" and memo.take(("a",)) == (None, None)  # out: a second caller builds its own
    memo.give(("a",), plan, slot=slot)
    assert memo.take(("a",))[0] == "plan-a"  # equal key, other tuple: the last-key path
    memo.give(("a",), "plan-a", slot=slot)
    memo.give(("b",), "plan-b")
    assert memo.take(("b",))[0] == "plan-b"  # now "a" is the least recently taken
    memo.give(("c",), "plan-c")  # past size: "a" goes
    assert len(memo) == 2 and memo.take(("a",)) == (None, None)
    plan, slot = memo.take(("c",))
    memo.give(("c",), plan, slot=slot)
    memo.give(("d",), "plan-d")  # drops "b"; "c", the last key taken, stays
    assert memo.take(("c",))[0] == "plan-c" and memo.take(("b",)) == (None, None)
    memo.clear()
    assert len(memo) == 0 and memo.take(("c",)) == (None, None)  # the last-key path does not outlive clear
    with pytest.raises(TypeError):
        memo.take((["unhashable"],))


def test_one_shot_plan_is_rebuilt_when_an_environment_switch_changes(fresh_memos, monkeypatch):
    """The switches a plan reads when built (FDFLEET_PREFILL_KERNEL, direct launches, our launcher) are
    in both memo keys, read on every call: a changed value builds new plans, the same value again
    finds them."""
    s = make_step(REQS, seed=8, **SMALL)
    monkeypatch.delenv("FDFLEET_PREFILL_KERNEL", raising=False)
    for _ in range(2):
        _assert_dense(s, _write_and_attend(s, scale=0.25), scale=0.25)
    assert fresh_memos == {"attend": 1, "write": 1}
    monkeypatch.setenv("FDFLEET_PREFILL_KERNEL", "portable")
    for _ in range(2):
        _assert_dense(s, _write_and_attend(s, scale=0.25), scale=0.25)
    assert fresh_memos == {"attend": 2, "write": 2}
    monkeypatch.setenv("FDFLEET_DIRECT_LAUNCH", "off")
    _assert_dense(s, _write_and_attend(s, scale=0.25), scale=0.25)
    assert fresh_memos == {"attend": 3, "write": 3}


def test_raw_reader_follows_the_environment_and_a_replaced_mapping(monkeypatch):
    import os

    from fastdeploy_paddlefleet import envs

    names = ("FDFLEET_TEST_A", "FDFLEET_TEST_B", "FDFLEET_TEST_C", "FDFLEET_TEST_D")
    three, four, one = envs.raw_reader(*names[:3]), envs.raw_reader(*names), envs.raw_reader(names[0])
    for n in names:
        monkeypatch.delenv(n, raising=False)
    assert three() == (None, None, None) == envs.raw_values(*names[:3]) and one() == (None,)
    assert four() == (None,) * 4
    monkeypatch.setenv("FDFLEET_TEST_B", "x")
    monkeypatch.setenv("FDFLEET_TEST_D", "z")
    assert three() == envs.raw_values(*names[:3]) and three()[1] in ("x", b"x") and three()[0] is None
    assert four() == envs.raw_values(*names) and four()[3] in ("z", b"z")
    monkeypatch.setattr(os, "environ", {"FDFLEET_TEST_A": "y"})  # another mapping: read by name
    assert three() == ("y", None, None) and one() == ("y",) and four() == ("y", None, None, None)
