"""The Triton backend's kept lane: calls whose kernels are compiled and kept, on paddle or torch tensors.

Under FastDeploy (paddle tensors; torch may be installed beside it) the backend used to cross every
call through DLPack views: three ``torch.from_dlpack`` and one paddle import of the output, ~40-50 us
of host per layer on this machine. Once a layer's kernels are kept, the lane launches them with
addresses read from the paddle tensors themselves. The reference here is the views' path: for the
same step and tensors, the lane must hand every kept kernel the very same arguments (grid, addresses,
strides, sizes, scalars), except the output's address (its own allocation, which must be a paddle
``[T, Hq * Dv]`` tensor of q's dtype), the split decode's partial buffers, and the stream (Paddle's
current one, read through the stream reader). The kernels are recorders: on a GPU the same kept
kernels then compute the same bytes (``tests/test_launch_cost.py`` checks kept kernels against
Triton's path there).
"""

from __future__ import annotations

import pytest

paddle = pytest.importorskip("paddle")
torch = pytest.importorskip("torch")

from fastdeploy_paddlefleet.backends import triton as tb  # noqa: E402
from fastdeploy_paddlefleet.kernels import _framework as fw  # noqa: E402
from fastdeploy_paddlefleet.kernels import cache_write as cw  # noqa: E402
from fastdeploy_paddlefleet.kernels import paged_attention as pa  # noqa: E402
from fastdeploy_paddlefleet.kernels.launch.direct import KernelCache  # noqa: E402
from fastdeploy_paddlefleet.plan.layer import LayerAttention  # noqa: E402
from fastdeploy_paddlefleet.runner.batch import build_meta  # noqa: E402

PADDLE_STREAM = 0x5EED
HQ, HKV, D, DV, BS = 4, 2, 16, 8, 16


class Recorder(KernelCache):
    """A kernel cache as on a GPU with every kernel compiled and kept (``direct``, addresses), whose
    kept kernels record ``(kind, grid, args, stream)``; kinds in :attr:`missing` are not kept."""

    calls: list = []
    missing: set = set()

    def __init__(self, device_index=None) -> None:
        super().__init__(None)
        self.direct, self.addresses, self.own, self.device_index = True, True, False, 0

    def stream(self) -> int:
        return 0  # torch's current stream (the views' path); the lane reads Paddle's

    def kernel(self, key):
        if key is None:
            return None
        kind = key[0] if isinstance(key[0], str) else "write"
        if kind in Recorder.missing:
            return None

        def hit(grid, args, stream):
            bad = [type(a).__name__ for a in args if hasattr(a, "data_ptr")]
            if bad:
                raise TypeError(f"a kept kernel was given tensors {bad}")
            Recorder.calls.append((kind, tuple(grid), tuple(args), stream))

        return hit

    def launch(self, fn, key, grid, args, consts, stream):
        raise RuntimeError(f"Triton's path taken (key {key!r})")


@pytest.fixture
def gpu_like(monkeypatch):
    """Kept kernels for every plan built now; CPU tensors of both frameworks read as on a GPU (what
    gates a direct launch); Paddle's current stream read as :data:`PADDLE_STREAM`."""
    monkeypatch.setattr(pa, "KernelCache", Recorder)
    monkeypatch.setattr(cw, "KernelCache", Recorder)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True), raising=False)
    monkeypatch.setattr(paddle.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(fw, "paddle_stream_reader", lambda index: lambda: PADDLE_STREAM)
    monkeypatch.setattr(Recorder, "calls", [])
    monkeypatch.setattr(Recorder, "missing", set())


def _step(dec, this, seed=0):
    gen = torch.Generator().manual_seed(seed)
    nblk = [-(-(c + n) // BS) for c, n in zip(dec, this, strict=True)]
    perm = iter(torch.randperm(sum(nblk) + 3, generator=gen).tolist())
    tables = [[next(perm) for _ in range(n)] for n in nblk]
    meta = build_meta(dec, this, tables, BS)
    t = sum(this)

    def rnd(*shape):
        return paddle.to_tensor(torch.randn(*shape, generator=gen).numpy())

    caches = (rnd(sum(nblk) + 3, HKV, BS, D), rnd(sum(nblk) + 3, HKV, BS, DV))
    return meta, rnd(t, HQ, D), rnd(t, HKV, D), rnd(t, HKV, DV), caches


LAYER = LayerAttention(
    index=0, kind="full", num_q_heads=HQ, num_kv_heads=HKV, qk_head_dim=D, v_head_dim=DV, softmax_scale=0.25
)
SINK_LAYER = LayerAttention(
    index=1, kind="sliding", num_q_heads=HQ, num_kv_heads=HKV, qk_head_dim=D, v_head_dim=DV,
    softmax_scale=0.25, window_left=50, sliding_kv_heads=(0, 1), sink="learnable",
)  # fmt: skip
# kernel kind -> argument positions that are fresh allocations: the output, the prefill's flags for its
# safe launch, the split partials (and the reduce's sink pointer without sinks: any pointer, the partials')
FRESH = {
    "write": (), "prefill": (3, 11), "prefill-safe": (3, 11), "decode": (3, 6, 7), "decode-fused": (3, 6, 7),
    "reduce": (0, 1, 2),
}  # fmt: skip
FRESH_NO_SINKS = {**FRESH, "reduce": (0, 1, 2, 3)}
STEPS = {
    "decode-split": ([400, 70, 1000], [1, 1, 1]),  # few programs: the decode splits, the reduce merges
    "prefill": ([0, 16], [16, 9]),
    "mixed": ([30, 0, 5], [1, 12, 1]),
}


def _not_run(*args, **kw):
    raise AssertionError("the call left the kept lane for _run")


def _forward(monkeypatch, backend, lane, meta, q, k, v, caches, layer=LAYER, sinks=None):
    """One ``forward`` with the lane on (it must serve: ``_run`` raises) or off; returns the output and
    the kept kernels' recorded launches."""
    monkeypatch.setattr(tb, "KEPT_LANE", lane)
    Recorder.calls.clear()
    with monkeypatch.context() as m:
        if lane:
            m.setattr(backend, "_run", _not_run)
        out = backend.forward(q, k, v, layer, meta, caches, sinks)
    return out, list(Recorder.calls)


def _as_torch(meta, q, k, v, caches, sinks):
    """The same step as torch tensors (copies)."""
    import dataclasses

    def conv(x):
        return torch.from_numpy(x.numpy()) if isinstance(x, paddle.Tensor) else x

    meta = type(meta)(**{f.name: conv(getattr(meta, f.name)) for f in dataclasses.fields(meta)})
    return meta, conv(q), conv(k), conv(v), (conv(caches[0]), conv(caches[1])), conv(sinks)


@pytest.mark.parametrize("fused", [False, True], ids=["write-launch", "fused-write"])
@pytest.mark.parametrize("framework", ["paddle", "torch"])
@pytest.mark.parametrize("sinks", [False, True], ids=["full", "window-sinks"])
@pytest.mark.parametrize("validate", [False, True], ids=["served", "fastdeploy-checks"])
@pytest.mark.parametrize("name", list(STEPS))
def test_lane_launches_what_the_views_launch(monkeypatch, gpu_like, name, validate, sinks, framework, fused):
    """Paddle: the lane against the DLPack views' path; torch: the lane against ``_run``'s plans; with
    and without the cache write fused into a decode-only step's decode (``FDFLEET_FUSED_DECODE_WRITE``)."""
    monkeypatch.setenv("FDFLEET_FUSED_DECODE_WRITE", "1" if fused else "0")
    meta, q, k, v, caches = _step(*STEPS[name])
    layer, sink_t = (SINK_LAYER, paddle.to_tensor([0.5, -1.0, 2.0, 0.0])) if sinks else (LAYER, None)
    if framework == "torch":
        meta, q, k, v, caches, sink_t = _as_torch(meta, q, k, v, caches, sink_t)
    backend = tb.TritonBackend(validate=validate, host_checks=False)
    # the views' path first: it builds the layer's plans and the step's state
    out_v, views = _forward(monkeypatch, backend, False, meta, q, k, v, caches, layer, sink_t)
    out_l, lane = _forward(monkeypatch, backend, True, meta, q, k, v, caches, layer, sink_t)
    kinds = [c[0] for c in views]
    if name == "decode-split" and fused:  # decode only: the cache write inside the decode launch
        assert kinds[0] == "decode-fused" and "write" not in kinds and "reduce" in kinds
    else:
        assert kinds[0] == "write" and len(views) >= 2
        assert name != "decode-split" or "reduce" in kinds
    assert [c[0] for c in lane] == kinds
    for (kind, grid_v, args_v, stream_v), (_, grid_l, args_l, stream_l) in zip(views, lane, strict=True):
        assert stream_v == 0 and stream_l == (PADDLE_STREAM if framework == "paddle" else 0), kind
        assert grid_l == grid_v, kind
        fresh = (FRESH if sinks else FRESH_NO_SINKS)[kind]
        assert [a for i, a in enumerate(args_l) if i not in fresh] == [
            a for i, a in enumerate(args_v) if i not in fresh
        ], kind
        if kind in ("prefill", "decode", "decode-fused"):
            assert args_v[3] == out_v.data_ptr() and args_l[3] == out_l.data_ptr()
        if kind == "decode-fused":  # the new K/V's addresses and strides: the caller's k and v, just
            # before the (unused here) cache scales: two pointers and their four strides
            assert args_l[-12:-6] == (k.data_ptr(), v.data_ptr(), *k.stride()[:2], *v.stride()[:2])
    assert type(out_l) is type(out_v) is (paddle.Tensor if framework == "paddle" else torch.Tensor)
    assert list(out_l.shape) == [q.shape[0], HQ * DV] and out_l.dtype == q.dtype
    assert out_l.data_ptr() != out_v.data_ptr()


def test_lane_steps_aside_until_every_kernel_is_kept(monkeypatch, gpu_like):
    """A step whose decode kernel is not kept yet (a new split count, say): the lane launches no
    attention and returns ``None``, so the views' path compiles; a backend that never ran the views
    (no plans, no error flag) and a q of another dtype do not take the lane either."""
    meta, q, k, v, caches = _step(*STEPS["mixed"])
    backend = tb.TritonBackend(validate=False, host_checks=False)
    assert backend._run_kept(q, k, v, LAYER, meta, caches, None, None, True) is None
    _forward(monkeypatch, backend, False, meta, q, k, v, caches)
    Recorder.missing = {"decode"}
    Recorder.calls.clear()
    assert backend._run_kept(q, k, v, LAYER, meta, caches, None, None, True) is None
    assert [c[0] for c in Recorder.calls] in ([], ["write"])  # a repeated write stores the same values
    Recorder.missing = set()
    q16 = q.astype("float16")
    assert backend._run_kept(q16, k, v, LAYER, meta, caches, None, None, True) is None


def test_lane_serves_a_new_steps_first_layer(monkeypatch, gpu_like):
    """A new step (new metadata tensors, same token count) on a layer whose kernels are kept: the lane
    derives the step's state itself, and its launches read the new step's metadata (the addresses of
    its int32 tensors: the views share their memory) and the backend's error flag."""
    meta, q, k, v, caches = _step(*STEPS["mixed"])
    backend = tb.TritonBackend(validate=True, host_checks=False)
    _forward(monkeypatch, backend, False, meta, q, k, v, caches)
    meta2, q2, k2, v2, _ = _step(*STEPS["mixed"], seed=1)
    out, lane = _forward(monkeypatch, backend, True, meta2, q2, k2, v2, caches)
    assert [c[0] for c in lane] == ["write", "prefill", "prefill-safe", "decode"]
    assert all(c[3] == PADDLE_STREAM for c in lane)
    (flag,) = backend.error_flags()
    want = (meta2.cu_seqlens_q.data_ptr(), meta2.seq_lens_decoder.data_ptr(), meta2.block_tables.data_ptr())
    write_args, prefill_args = lane[0][2], lane[1][2]
    assert write_args[4] == meta2.batch_id_per_token.data_ptr() and write_args[5:9] == (
        *want,
        flag.data_ptr(),
    )
    assert prefill_args[0] == q2.data_ptr() and prefill_args[7:11] == (*want, flag.data_ptr())
    assert write_args[0] == k2.data_ptr() and write_args[1] == v2.data_ptr()
    assert list(out.shape) == [q2.shape[0], HQ * DV]


def test_lane_off_the_gpu_keeps_the_views(monkeypatch, gpu_like):
    """CPU tensors (``is_cuda`` False) never take the lane."""
    meta, q, k, v, caches = _step(*STEPS["decode-split"])
    backend = tb.TritonBackend(validate=False, host_checks=False)
    _forward(monkeypatch, backend, False, meta, q, k, v, caches)
    monkeypatch.setattr(paddle.Tensor, "is_cuda", property(lambda self: False))
    assert backend._run_kept(q, k, v, LAYER, meta, caches, None, None, True) is None


def test_paddle_lane_derives_no_step_for_another_device(monkeypatch, gpu_like):
    """The step's metadata views go to the device of the backend's torch error flag: a q on another
    GPU (its place's device id differs) must not get a step derived there (the views' path derives
    it on q's device)."""
    meta, q, k, v, caches = _step(*STEPS["mixed"])
    backend = tb.TritonBackend(validate=False, host_checks=False)
    _forward(monkeypatch, backend, False, meta, q, k, v, caches)
    meta2, q2, k2, v2, _ = _step(*STEPS["mixed"], seed=1)

    class OtherGpu:
        def gpu_device_id(self):
            return 1

    monkeypatch.setattr(paddle.Tensor, "place", property(lambda self: OtherGpu()))
    assert backend._run_kept(q2, k2, v2, LAYER, meta2, caches, None, None, True) is None
    assert tb._STEP_ATTR not in meta2.__dict__


def test_paddle_lane_derives_a_step_on_paddles_stream(monkeypatch, gpu_like):
    """A new step's metadata views (and any int32 conversion or copy of them) are made with Paddle's
    stream as torch's current one, as the views' path does: the kernels launched on Paddle's stream
    then read them in order."""
    import contextlib

    meta, q, k, v, caches = _step(*STEPS["mixed"])
    backend = tb.TritonBackend(validate=False, host_checks=False)
    _forward(monkeypatch, backend, False, meta, q, k, v, caches)
    depth, seen = [0], []

    @contextlib.contextmanager
    def on_paddles_stream(device):
        depth[0] += 1
        try:
            yield
        finally:
            depth[0] -= 1

    state_init = tb._StepState.__init__

    def recording_init(self, *a, **kw):
        seen.append(depth[0])
        state_init(self, *a, **kw)

    monkeypatch.setattr(fw, "paddle_stream", on_paddles_stream)
    monkeypatch.setattr(tb._StepState, "__init__", recording_init)
    meta2, q2, k2, v2, _ = _step(*STEPS["mixed"], seed=1)
    out, lane = _forward(monkeypatch, backend, True, meta2, q2, k2, v2, caches)
    assert seen == [1] and lane
