"""Whether the installed Triton builds the Hopper prefill kernel (:mod:`.hopper_prefill`), once per process.

Gluon's API moves between Triton releases (3.6's ``async_copy_global_to_shared`` is 3.9's
``async_load``), and a kernel that compiles is not yet a kernel whose results were checked: the GPU
tests (``tests/test_hopper_prefill.py``) ran on the Triton versions in :data:`TESTED_TRITON` only.
:func:`triton_blocks` is the hook of :func:`.hopper_prefill.choose_prefill_impl`, asked once the inputs
suit the Hopper kernel on an sm_90 GPU:

* a tested version: the Hopper kernel (``tests/test_hopper_support.py`` compiles it for sm_90a with
  the installed Triton on any machine, and fails where a version this module lets ``auto`` choose
  does not compile);
* another version, ``FDFLEET_PREFILL_KERNEL=auto``: the portable kernel, with one WARNING per process
  naming the version; no compile is tried (a kernel that compiles may still compute wrong results, and
  the check costs seconds of ptxas on a serving process's first prefill);
* another version, ``hopper``: one representative specialisation (:data:`PROBE_CASE`, head dims
  128 / 128) compiled for the device, once per process (:func:`compile_error`); when it fails the
  selection raises ``ValueError`` naming the version and the error, else the Hopper kernel runs with
  one WARNING that the version is untested.

``benchmarks/probes/hopper_compile.py`` compiles through :func:`compile_case` too (resources, SASS).
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

logger = logging.getLogger(__name__)

#: ``major.minor`` of the Triton releases the Hopper kernel's GPU tests passed on (the H200's 3.6)
TESTED_TRITON: frozenset[str] = frozenset({"3.6"})
#: the specialisation :func:`compile_error` compiles: GQA 32 / 8 at head dims 128 / 128, learnable sinks
PROBE_CASE: dict[str, Any] = {"dqk": 128, "dv": 128, "hq": 32, "hkv": 8}
#: what :func:`triton_blocks` warned about in this process (one WARNING each)
_warned: set[str] = set()


def triton_version() -> str:
    """The installed Triton's version string, or ``"none"``."""
    try:
        import triton
    except ImportError:
        return "none"
    return str(getattr(triton, "__version__", "unknown"))


def _major_minor(version: str) -> str:
    m = re.match(r"(\d+)\.(\d+)", version)
    return f"{m[1]}.{m[2]}" if m else version


def triton_tested(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed Triton's) is a release in :data:`TESTED_TRITON`."""
    return _major_minor(triton_version() if version is None else version) in TESTED_TRITON


def compile_case(case: dict[str, Any], device: Any = None) -> tuple[Any, dict[str, Any]]:
    """Compile the Hopper kernel's specialisation ``case`` (``dqk``, ``dv``; optionally ``hq``, ``hkv``,
    ``bs``, ``sink_mode``, ``has_window``, ``headwise`` and any :class:`.hopper_prefill.HopperPlan`
    keyword) for the target of Triton's active driver, without launching it. Returns the compiled
    kernel (``asm``, ``metadata``) and the plan's compile-time constants. ``device``: where the plan's
    small tensors live (default: the current CUDA device when there is one, else the CPU, as with a
    stub driver that targets sm_90)."""
    import torch

    from . import hopper_prefill as hp

    if not hp.gluon_available():
        raise ValueError(f"gluon unavailable with Triton {triton_version()}: {hp.GLUON_IMPORT_ERROR!r}")
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    c = dict(case)
    dqk, dv = c.pop("dqk"), c.pop("dv")
    hq, hkv, bs = c.pop("hq", 16), c.pop("hkv", 16), c.pop("bs", 64)
    sink_mode, has_window = c.pop("sink_mode", 1), c.pop("has_window", False)
    headwise = c.pop("headwise", False)
    c.setdefault("num_ctas", 132)  # no device query: the grid size is a launch argument, not compiled in
    kw = dict(dtype=torch.bfloat16, device=device)
    kc, vc = torch.zeros(8, hkv, bs, dqk, **kw), torch.zeros(8, hkv, bs, dv, **kw)
    q, out = torch.zeros(64, hq, dqk, **kw), torch.zeros(64, hq, dv, **kw)
    sinks = torch.zeros(hq, dtype=torch.float32, device=device)
    plan = hp.HopperPlan(kc, vc, hq, sinks, qk_scale=0.1, sink_mode=sink_mode, headwise=headwise,
                         has_window=has_window, window=100, win_h0=0, win_h1=hkv, **c)  # fmt: skip
    cu = torch.tensor([0, 64], dtype=torch.int32, device=device)
    tbl = torch.zeros(1, 4, dtype=torch.int32, device=device)
    err = torch.zeros(8, dtype=torch.int32, device=device)
    args = (q, out, vc, plan.k_desc, plan.v_desc, sinks, cu, cu[:1], tbl, err, plan.redo,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), vc.stride(2), tbl.stride(0), tbl.shape[1],
            plan.n_pages, q.shape[0], 1, 2, *plan.scalars, 16)  # fmt: skip
    return hp._hopper_prefill_kernel.warmup(*args, grid=(1,), **plan._consts[True]), plan.consts


@functools.lru_cache(maxsize=1)
def compile_error() -> str | None:
    """``None`` when :data:`PROBE_CASE` compiles with the installed Triton for the active device (tried
    once per process), else the error, shortened."""
    try:
        compile_case(PROBE_CASE)
    except Exception as e:  # noqa: BLE001 - any failure to build means: it does not compile here
        text = f"{type(e).__name__}: {e}"
        return text if len(text) <= 600 else text[:300] + " ... " + text[-300:]
    return None


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def triton_blocks(choice: str) -> str | None:
    """``None`` when the installed Triton may run the Hopper kernel for ``FDFLEET_PREFILL_KERNEL`` /
    ``prefill_impl`` ``choice`` (``"auto"`` or ``"hopper"``), else the reason it may not (module doc).
    Asked only where the inputs suit the Hopper kernel on an sm_90 GPU."""
    if choice not in ("auto", "hopper"):
        raise ValueError(f"choice must be 'auto' or 'hopper', got {choice!r}")
    version = triton_version()
    if triton_tested(version):
        return None
    tested = ", ".join(sorted(TESTED_TRITON))
    if choice == "auto":
        why = f"Triton {version} is not a release the Hopper prefill kernel was tested on ({tested})"
        _warn_once(
            "auto",
            f"{why}: prefill runs on the portable Triton kernel (FDFLEET_PREFILL_KERNEL=hopper runs the "
            "Hopper kernel anyway where it compiles)",
        )
        return why
    error = compile_error()
    if error is not None:
        return f"it does not compile with Triton {version} (tested on {tested}): {error}"
    _warn_once(
        "hopper",
        f"the Hopper prefill kernel runs on Triton {version}, a release it was not tested on ({tested}): it "
        "compiles; its results were checked on the tested releases only",
    )
    return None


__all__ = [
    "PROBE_CASE",
    "TESTED_TRITON",
    "compile_case",
    "compile_error",
    "triton_blocks",
    "triton_tested",
    "triton_version",
]
