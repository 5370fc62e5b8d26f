"""The Hopper prefill kernel against the installed Triton (``kernels/hopper_support.py``): on any machine.

``test_selection_agrees_with_the_compile`` compiles the Hopper kernel for sm_90a with the installed
Triton (a stub driver stands in for the GPU, as in ``benchmarks/probes/hopper_compile.py``) and FAILS
where ``FDFLEET_PREFILL_KERNEL=auto`` or ``hopper`` would take a kernel that does not compile. The other
cases check the selection's logic with the version and the compile result stood in.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fastdeploy_paddlefleet.kernels import hopper_prefill as hp  # noqa: E402
from fastdeploy_paddlefleet.kernels import hopper_support as hs  # noqa: E402

#: one specialisation per tile shape (tile_for): 128 / 128 with two Q buffers, MLA's 192 / 128 (three
#: chained 64-column wgmma's), 256 / 256 with 64-key tiles; windows and head-wise tables on two of them
CASES = [
    dict(dqk=128, dv=128, hq=32, hkv=8),
    dict(dqk=192, dv=128, hq=16, hkv=16, has_window=True),
    dict(dqk=256, dv=256, hq=32, hkv=8, headwise=True, has_window=True),
]


@contextlib.contextmanager
def sm90_target() -> Iterator[None]:
    """Triton compiles for sm_90 (device 0, stream 0) on a machine without a GPU, inside the block."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class _Stub:
        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: object = None) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

    previous = driver._active  # None until first used: reset_active would build the default driver
    driver.set_active(_Stub())
    try:
        yield
    finally:
        driver._active = previous


def _cause(e: BaseException) -> str:
    """The innermost exception of ``e``'s chain (a CompilationError's cause), shortened."""
    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    return f"{type(e).__name__}: {str(e)[-1500:]}"


@pytest.fixture
def fresh(monkeypatch):
    """No WARNING issued and no compile result kept by an earlier test."""
    monkeypatch.setattr(hs, "_warned", set())
    compile_error = hs.compile_error  # the cached one (tests stand others in)
    compile_error.cache_clear()
    yield
    compile_error.cache_clear()


def compile_all() -> dict:
    """Compile :data:`CASES` for sm_90a and ask the selection what it allows, in this process."""
    errors = {}
    with sm90_target():
        for case in CASES:
            try:
                kernel, _ = hs.compile_case(case, device=torch.device("cpu"))
                if not kernel.asm.get("cubin"):
                    raise ValueError("no cubin")
            except Exception as e:  # noqa: BLE001 - every case's error is reported, with its cause
                errors[json.dumps(case)] = _cause(e)
        hopper_refused = hs.triton_blocks("hopper")
    return dict(version=hs.triton_version(), tested=hs.triton_tested(), errors=errors,
                hopper_refused=hopper_refused, auto_refused=hs.triton_blocks("auto"))  # fmt: skip


@pytest.mark.skipif(not hp.gluon_available(), reason=f"gluon unavailable: {hp.GLUON_IMPORT_ERROR!r}")
def test_selection_agrees_with_the_compile():
    """The Hopper kernel compiles for sm_90a with the installed Triton wherever ``auto`` picks it (a
    tested release), and ``hopper`` is refused exactly where the representative case does not compile.
    In a process of its own without ``TRITON_INTERPRET`` (conftest.py sets it on machines without a GPU,
    and Triton 3.6's interpreter then stands in for the library functions Gluon calls)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    if r["tested"]:
        assert not r["errors"], (
            f"auto picks the Hopper kernel on Triton {r['version']}, which does not compile it"
        )
        assert r["auto_refused"] is None and r["hopper_refused"] is None
    else:  # auto falls back; hopper runs where the representative case compiles
        assert r["auto_refused"] is not None and r["version"] in r["auto_refused"]
        probe_failed = json.dumps(hs.PROBE_CASE) in r["errors"]
        assert (r["hopper_refused"] is not None) == probe_failed, r
        if probe_failed:
            assert r["version"] in r["hopper_refused"]


def test_untested_triton_auto_falls_back_with_one_warning(fresh, monkeypatch, caplog):
    monkeypatch.setattr(hs, "triton_version", lambda: "3.99.1")
    monkeypatch.setattr(hs, "compile_error", lambda: pytest.fail("auto must not compile"))
    with caplog.at_level(logging.WARNING, logger=hs.__name__):
        for _ in range(3):
            why = hs.triton_blocks("auto")
            assert why is not None and "Triton 3.99.1" in why
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "3.99.1" in warnings[0].getMessage()
    assert "portable" in warnings[0].getMessage()


def test_untested_triton_hopper_compiles_first(fresh, monkeypatch, caplog):
    monkeypatch.setattr(hs, "triton_version", lambda: "3.99.1")
    monkeypatch.setattr(hs, "compile_error", lambda: "CompilationError: no such op")
    why = hs.triton_blocks("hopper")
    assert why is not None and "3.99.1" in why and "no such op" in why
    # through the selection: a clear ValueError naming the version (inputs stood in as suitable)
    monkeypatch.setattr(hp, "supported", lambda *args: None)
    q = torch.zeros(4, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"Triton 3\.99\.1.*no such op"):
        hp.choose_prefill_impl("hopper", None, q, q, q)
    assert hp.choose_prefill_impl("auto", None, q, q, q) == "portable"
    # where it compiles: the Hopper kernel, one WARNING that the release is untested
    monkeypatch.setattr(hs, "compile_error", lambda: None)
    with caplog.at_level(logging.WARNING, logger=hs.__name__):
        assert hp.choose_prefill_impl("hopper", None, q, q, q) == "hopper"
        assert hp.choose_prefill_impl("hopper", None, q, q, q) == "hopper"
    untested = [r for r in caplog.records if "not tested on" in r.getMessage()]
    assert len(untested) == 1 and "3.99.1" in untested[0].getMessage()


def test_tested_triton_takes_the_hopper_kernel_without_a_compile(fresh, monkeypatch, caplog):
    monkeypatch.setattr(hs, "triton_version", lambda: "3.6.0+git1234")
    monkeypatch.setattr(
        hs, "compile_error", lambda: pytest.fail("a tested release is not compiled at runtime")
    )
    with caplog.at_level(logging.WARNING, logger=hs.__name__):
        assert hs.triton_blocks("auto") is None and hs.triton_blocks("hopper") is None
    assert not caplog.records
    monkeypatch.setattr(hp, "supported", lambda *args: None)
    q = torch.zeros(4, 8, 128, dtype=torch.bfloat16)
    assert hp.choose_prefill_impl(None, None, q, q, q) == "hopper"


def test_version_parsing_and_arguments():
    assert hs.triton_tested("3.6.0") and hs.triton_tested("3.6.1.dev0") and hs.triton_tested("3.6")
    assert not hs.triton_tested("3.9.0") and not hs.triton_tested("3.60.0") and not hs.triton_tested("none")
    with pytest.raises(ValueError, match="'portable'"):
        hs.triton_blocks("portable")


if __name__ == "__main__":  # test_selection_agrees_with_the_compile's own process
    print(json.dumps(compile_all()))
