"""Served-mode memory safety of the kernels (issue 19.1): bad block-table entries are never
dereferenced and the first one is recorded in the device error flag.

Each case builds a valid packed step (``test_triton_kernels.make_step``: NaN-filled cache, shuffled
blocks, released pages), then corrupts one table entry that a query needs: a page id past the cache
(huge, so a dereference would leave the process's memory), a ``-1`` inside the visible range, or a
table narrower than the context. The kernels must not crash, the flag must name the entry (request,
logical block, value, kernel) and :func:`check_kernel_errors` must raise a ``ValueError`` naming it.
Requests whose tables are intact must still match the dense reference, and valid steps leave the
flag clear. On CPU the kernels run under ``TRITON_INTERPRET=1`` (fp32 / fp16); the ``gpu`` cases
repeat this compiled, in bf16, the Hopper prefill included, and then run a clean step on the same
device to show it survived (no illegal address).
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from test_triton_kernels import CUDA, DEVICE, REAL, make_step, run_and_check  # noqa: E402

from fastdeploy_paddlefleet.kernels import hopper_prefill as hp  # noqa: E402
from fastdeploy_paddlefleet.kernels.cache_write import write_kv_cache  # noqa: E402
from fastdeploy_paddlefleet.kernels.dense_reference import dense_attention  # noqa: E402
from fastdeploy_paddlefleet.kernels.errors import (  # noqa: E402
    KernelErrorMonitor,
    check_kernel_errors,
    new_error_flag,
    reset_kernel_errors,
)
from fastdeploy_paddlefleet.kernels.paged_attention import paged_attention  # noqa: E402

HOPPER = CUDA and hp.is_hopper(torch.device("cuda")) and hp.gluon_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU and triton.experimental.gluon")

HUGE = 2**30  # a dereference would land gigabytes past the cache


def flag_values(flag) -> list[int]:
    return [int(x) for x in flag.cpu().tolist()]


def attend(s, flag, **kw):
    """Write the step's K/V (with the flag) and attend; ``out`` starts as NaN."""
    write_kv_cache(
        s.k, s.v, s.key_cache, s.value_cache, s.bid, s.cu, s.dec, s.table, headwise=s.headwise, errors=flag
    )
    out = torch.full((s.q.shape[0], s.q.shape[1], s.value_cache.shape[3]), float("nan"), dtype=s.q.dtype)
    out = out.to(s.q.device)
    return paged_attention(
        s.q, s.key_cache, s.value_cache, s.cu, s.dec, s.table,
        scale=1.0 / math.sqrt(s.q.shape[2]), headwise=s.headwise, out=out, errors=flag, **kw,
    )  # fmt: skip


def check_intact_requests(s, out, bad: set[int], **kw):
    """Every request not in ``bad`` matches the dense reference."""
    tol = {torch.float32: 1e-4 if not CUDA else 3e-3, torch.float16: 3e-3, torch.bfloat16: 2e-2}[s.q.dtype]
    for b, (_, n) in enumerate(s.reqs):
        if n == 0 or b in bad:
            continue
        lo, hi = int(s.cu[b]), int(s.cu[b + 1])
        want = dense_attention(
            s.q[lo:hi], s.hist_k[b], s.hist_v[b], scale=1.0 / math.sqrt(s.q.shape[2]),
            compute_dtype=torch.float64 if not CUDA else torch.float32, **kw,
        )  # fmt: skip
        got = out[lo:hi].to(want.dtype)
        assert torch.isfinite(got).all(), f"request {b}"
        err = float((got - want).norm() / want.norm().clamp_min(1e-6))
        assert err <= tol, f"request {b}: relative error {err:.2e}"


def expect_error(flag, *, code, req, blk, value, kernel, head=-1):
    got = flag_values(flag)
    assert got[:6] == [code, req, blk, value, head, kernel], got
    with pytest.raises(ValueError) as e:
        check_kernel_errors(flag)
    msg = str(e.value)
    assert f"request {req}" in msg and f"logical block {blk}" in msg and str(value) in msg, msg
    return msg


# ------------------------------------------------------------------------------ valid inputs


@pytest.mark.parametrize(
    "case",
    [
        dict(build=dict(block_size=16), attend=dict()),
        dict(build=dict(block_size=4, window_left=5, release=True), attend=dict(window_left=5)),
        dict(build=dict(block_size=1, window_left=3, release=True), attend=dict(window_left=3, num_splits=3)),
        dict(
            build=dict(block_size=8, headwise=True, window_left=6, sliding_heads=(1, 2), release=True),
            attend=dict(window_left=6, sliding_heads=(1, 2)),
        ),
    ],
    ids=["full", "window-released-pages", "block1-splits", "headwise-released"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_valid_steps_leave_the_flag_clear_and_results_unchanged(case, dtype):
    reqs = [(30, 6), (45, 1), (0, 9), (17, 1)]
    s = make_step(reqs, hkv=2, group=2, dqk=16, dv=16, dtype=dtype, seed=3, **case["build"])
    assert not case["build"].get("release") or (s.table == -1).any()  # released pages outside windows
    flag = new_error_flag(s.q)
    write_kv_cache(
        s.k, s.v, s.key_cache, s.value_cache, s.bid, s.cu, s.dec, s.table, headwise=s.headwise, errors=flag
    )
    run_and_check(s, errors=flag, **case["attend"])
    assert flag_values(flag) == [0] * 8
    check_kernel_errors(flag)  # clear: no raise


# ------------------------------------------------------------------------------ bad entries

REQS = [(40, 1), (20, 7), (0, 5), (33, 1)]  # two decodes, a chunk with context, a fresh prefill


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 4])  # a key tile inside one page / spanning pages
def test_page_past_the_cache_in_a_decode_request(dtype, block_size):
    s = make_step(REQS, hkv=2, group=2, dqk=16, dv=16, block_size=block_size, dtype=dtype, seed=1)
    s.table[0, 1] = HUGE  # request 0 (decode at position 40) sees logical block 1
    flag = new_error_flag(s.q)
    out = attend(s, flag)
    msg = expect_error(flag, code=1, req=0, blk=1, value=HUGE, kernel=3)
    assert "decode" in msg and "past the cache" in msg
    check_intact_requests(s, out, bad={0})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_negative_page_inside_the_visible_range_of_a_prefill(dtype):
    s = make_step(REQS, hkv=2, group=2, dqk=16, dv=16, block_size=8, dtype=dtype, seed=2)
    s.table[1, 0] = -1  # request 1 (20 cached + 7 new): block 0 is visible to every query
    flag = new_error_flag(s.q)
    out = attend(s, flag)
    msg = expect_error(flag, code=2, req=1, blk=0, value=-1, kernel=2)
    assert "prefill" in msg and "negative" in msg
    check_intact_requests(s, out, bad={1})


@pytest.mark.parametrize("in_loop", [False, True])
@pytest.mark.parametrize("block_size", [16, 4])
def test_scan_after_the_loop_records_the_same_entries(monkeypatch, block_size, in_loop):
    """Both ways to find the first bad entry (one scan of the visible table range after the key loop,
    or the smallest bad block carried through the loop) name the same entries."""
    from fastdeploy_paddlefleet.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "ERR_LOOP_PREFILL", in_loop)
    monkeypatch.setattr(pa, "ERR_LOOP_DECODE", in_loop)
    s = make_step(REQS, hkv=2, group=2, dqk=16, dv=16, block_size=block_size, seed=1)
    s.table[0, 1] = HUGE
    flag = new_error_flag(s.q)
    out = attend(s, flag)
    expect_error(flag, code=1, req=0, blk=1, value=HUGE, kernel=3)
    check_intact_requests(s, out, bad={0})
    s = make_step(REQS, hkv=2, group=2, dqk=16, dv=16, block_size=block_size, seed=2)
    s.table[1, 0] = -1
    reset_kernel_errors(flag)
    attend(s, flag)
    expect_error(flag, code=2, req=1, blk=0, value=-1, kernel=2)


def test_any_negative_value_is_refused_too():
    s = make_step(REQS, hkv=2, group=2, dqk=16, dv=16, block_size=8, seed=2)
    s.table[3, 2] = -(2**31)  # request 3, decode at position 33: block 2 visible
    flag = new_error_flag(s.q)
    out = attend(s, flag)
    expect_error(flag, code=2, req=3, blk=2, value=-(2**31), kernel=3)
    check_intact_requests(s, out, bad={3})


def test_table_narrower_than_the_context():
    s = make_step(REQS, hkv=2, group=2, dqk=16, dv=16, block_size=8, seed=4)
    s.table = s.table[:, :3].contiguous()  # 3 columns = 24 positions; requests 0 and 3 need block 4
    flag = new_error_flag(s.q)
    out = attend(s, flag)
    got = flag_values(flag)
    assert got[0] == 3 and got[1] in (0, 1, 3) and got[3] == 3, got  # value: the table's width
    with pytest.raises(ValueError, match=r"only 3 columns"):
        check_kernel_errors(flag)
    check_intact_requests(s, out, bad={0, 1, 3})  # request 2 (5 tokens) fits in 3 columns


def test_cache_write_refuses_a_bad_page_for_a_written_token():
    s = make_step(REQS, hkv=2, group=2, dqk=16, dv=16, block_size=8, seed=5)
    s.table[2, 0] = HUGE  # request 2's tokens 0..4 are written to block 0
    kc0, vc0 = s.key_cache.clone(), s.value_cache.clone()
    flag = new_error_flag(s.q)
    write_kv_cache(s.k, s.v, s.key_cache, s.value_cache, s.bid, s.cu, s.dec, s.table, errors=flag)
    expect_error(flag, code=1, req=2, blk=0, value=HUGE, kernel=1)
    # the other requests' tokens landed in their blocks; no other block changed
    changed = (s.key_cache.nan_to_num(7.0) != kc0.nan_to_num(7.0)).any(dim=(1, 2, 3))
    want = {int(s.table[b, pos // 8]) for b, (c, n) in enumerate(REQS) if b != 2 for pos in range(c, c + n)}
    assert set(torch.nonzero(changed).flatten().tolist()) == want
    changed_v = (s.value_cache.nan_to_num(7.0) != vc0.nan_to_num(7.0)).any(dim=(1, 2, 3))
    assert set(torch.nonzero(changed_v).flatten().tolist()) == want


def test_headwise_page_names_the_kv_head():
    reqs = [(30, 4), (50, 1)]
    s = make_step(reqs, hkv=4, group=2, dqk=16, dv=16, block_size=8, headwise=True, seed=6)
    nb = s.key_cache.shape[0]
    s.table[1 * 4 + 3, 5] = nb * 4  # request 1, kv head 3, logical block 5: one past the last page
    flag = new_error_flag(s.q)
    out = attend(s, flag)
    msg = expect_error(flag, code=1, req=1, blk=5, value=nb * 4, kernel=3, head=3)
    assert "kv head 3" in msg and f"({nb * 4} pages)" in msg
    check_intact_requests(s, out, bad={1})


def test_split_kv_decode_records_and_stays_inside():
    s = make_step([(300, 1), (90, 1)], hkv=2, group=4, dqk=16, dv=16, block_size=16, seed=7)
    s.table[0, 17] = HUGE
    flag = new_error_flag(s.q)
    out = attend(s, flag, num_splits=4)
    expect_error(flag, code=1, req=0, blk=17, value=HUGE, kernel=3)
    check_intact_requests(s, out, bad={0})


def test_released_pages_outside_the_window_are_not_errors_but_inside_are():
    s = make_step(
        [(60, 1), (50, 6)], hkv=2, group=2, dqk=16, dv=16, block_size=4, window_left=9, release=True
    )
    released = (s.table == -1).sum()
    assert released > 0
    flag = new_error_flag(s.q)
    attend(s, flag, window_left=9)
    assert flag_values(flag)[0] == 0
    s.table[0, 13] = -1  # position 52..55: inside request 0's window (51..60)
    attend(s, flag, window_left=9)
    expect_error(flag, code=2, req=0, blk=13, value=-1, kernel=3)


def test_first_error_wins_and_reset_clears():
    s = make_step(REQS, hkv=2, group=2, dqk=16, dv=16, block_size=8, seed=8)
    s.table[0, 1] = HUGE
    flag = new_error_flag(s.q)
    attend(s, flag)
    first = flag_values(flag)
    s.table[0, 1] = 2
    s.table[3, 0] = -1
    attend(s, flag)  # a later bad entry does not overwrite the first
    assert flag_values(flag) == first
    reset_kernel_errors(flag)
    assert flag_values(flag) == [0] * 8
    check_kernel_errors(flag)


def test_monitor_checks_every_n_steps():
    s = make_step(REQS, hkv=2, group=2, dqk=16, dv=16, block_size=8, seed=9)
    s.table[3, 1] = HUGE
    mon = KernelErrorMonitor(new_error_flag(s.q), every=3)
    attend(s, mon.flag)
    mon.step()
    mon.step()  # not yet checked: no sync, no raise
    with pytest.raises(ValueError, match="request 3, logical block 1"):
        mon.step()
    assert flag_values(mon.flag)[0] == 0  # cleared after reporting
    mon.step()
    mon.step()
    mon.step()  # clean since
    with pytest.raises(ValueError, match="every"):
        KernelErrorMonitor(mon.flag, every=-1)


def test_backend_served_mode_reports_named_error():
    """The triton backend with content checks off (FastDeploy's served mode): no crash, the step's
    bad entry comes back from ``check_errors`` / ``step_done`` as a named ValueError."""
    from test_triton_kernels import _layer, _meta

    from fastdeploy_paddlefleet.backends.triton import TritonBackend

    s = make_step([(12, 5), (30, 1)], hkv=2, group=2, dqk=16, dv=16, block_size=8, seed=10)
    s.table[1, 2] = HUGE
    backend = TritonBackend(validate=False, host_checks=False, check_every=2)
    layer = _layer(2, 2, 16, 16)
    out = backend.forward(s.q, s.k, s.v, layer, _meta(s, 8), (s.key_cache, s.value_cache))
    assert out.shape == (6, 2 * 2 * 16)
    backend.step_done()  # step 1 of 2: no check
    with pytest.raises(ValueError, match=rf"request 1, logical block 2: entry {HUGE}"):
        backend.step_done()
    backend.check_errors()  # cleared after reporting
    with pytest.raises(ValueError, match="check_every"):
        TritonBackend(check_every=-2)


# ------------------------------------------------------------------------------ GPU


def _survives(device):
    """A clean step after the bad ones: the context is healthy (an illegal address would be sticky)."""
    torch.cuda.synchronize(device)
    s = make_step([(100, 1), (10, 20)], dtype=torch.bfloat16, seed=99, **REAL)
    run_and_check(s)
    torch.cuda.synchronize(device)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("impl", ["portable", "hopper"])
@pytest.mark.parametrize("bad", ["huge", "minus1", "narrow"])
def test_gpu_bad_tables_are_named_not_illegal_addresses(impl, bad):
    if impl == "hopper" and not HOPPER:
        pytest.skip("needs an sm_90 GPU and triton.experimental.gluon")
    reqs = [(1000, 300), (3000, 1), (10, 1), (0, 200), (500, 64)]
    s = make_step(reqs, dtype=torch.bfloat16, seed=21, **REAL)
    if bad == "huge":
        s.table[0, 3] = HUGE  # prefill request 0 needs block 3
        want = dict(code=1, req=0, blk=3, value=HUGE)
    elif bad == "minus1":
        s.table[1, 20] = -1  # decode request 1 needs block 20
        want = dict(code=2, req=1, blk=20, value=-1)
    else:
        s.table = s.table[:, :10].contiguous()  # 640 positions: requests 0, 1 need more
        want = None
    flag = new_error_flag(s.q)
    out = attend(s, flag, prefill_impl=impl)
    torch.cuda.synchronize()
    got = flag_values(flag)
    if want is not None:
        assert got[:4] == [want["code"], want["req"], want["blk"], want["value"]], got
        bad_reqs = {want["req"]}
    else:
        assert got[0] == 3 and got[1] in (0, 1) and got[3] == 10, got
        bad_reqs = {0, 1}
    with pytest.raises(ValueError, match=f"request {got[1]}, logical block {got[2]}"):
        check_kernel_errors(flag)
    check_intact_requests(s, out, bad=bad_reqs)
    _survives(s.q.device)


@pytest.mark.gpu_long  # -m gpu stays under 5 minutes: run with -m gpu_long
@gpu
def test_gpu_valid_steps_leave_the_flag_clear():
    for impl in ("portable", "hopper") if HOPPER else ("portable",):
        for kw in (dict(), dict(window_left=200, release=True)):
            reqs = [(1000, 700), (0, 513), (37, 1), (2000, 1), (64, 64)]
            s = make_step(reqs, dtype=torch.bfloat16, seed=3, **kw, **REAL)
            flag = new_error_flag(s.q)
            write_kv_cache(s.k, s.v, s.key_cache, s.value_cache, s.bid, s.cu, s.dec, s.table, errors=flag)
            run_and_check(s, window_left=kw.get("window_left"), prefill_impl=impl, errors=flag)
            assert flag_values(flag) == [0] * 8, (impl, kw)
    assert DEVICE.type == "cuda"
