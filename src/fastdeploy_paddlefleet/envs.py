"""The plugin's environment switches: one registry (:data:`VARIABLES`), parsed strictly (stdlib only).

Every ``FDFLEET_*`` name the plugin, its tests or its CI reads has one :class:`Variable` here (name,
parser, default, doc); nothing else in the package reads ``os.environ`` for one of them by parsing it
itself.

* ``FDFLEET_BACKEND``: ``auto`` (default) | ``reference`` | ``triton``
* ``FDFLEET_HEADWISE_KV``: boolean, default ``False``
* ``FDFLEET_PREFILL_KERNEL``: ``auto`` (default) | ``hopper`` | ``portable``
* ``FDFLEET_KV_RECYCLE``: ``auto`` (default) | ``off``
* ``FDFLEET_DIRECT_LAUNCH``: boolean, default ``True``
* ``FDFLEET_OWN_LAUNCHER``: boolean, default ``True``
* ``FDFLEET_FUSED_DECODE_WRITE``: boolean, default ``False``
* ``FDFLEET_DECODE_KEY_ROWS``: boolean, default ``True``
* ``FDFLEET_DEQUANT_SCRATCH_MB``: an integer >= 0, default ``512``
* ``FDFLEET_LOG_LEVEL``: ``DEBUG`` | ``INFO`` | ``WARNING`` (default) | ``ERROR`` | ``CRITICAL``
* ``FDFLEET_MODEL_IMPL``: ``paddlefleet`` or unset; set by the plugin itself when
  ``--model-impl paddlefleet`` is chosen (FastDeploy then sees ``auto``)
* ``FDFLEET_HOST_FASTDEPLOY``, ``FDFLEET_HOST_PADDLEFLEET``, ``FDFLEET_TRITON36_SITE``: tests and CI
  only (folders; known names, never parsed)

Values are case-insensitive and may carry surrounding whitespace. An empty
value counts as unset (so ``FDFLEET_BACKEND= cmd`` gives the default); any
other value outside the accepted set raises ``ValueError`` naming the variable
and the value.

When: every getter reads ``os.environ`` when called (a test or a launcher may set a variable after
import), and *importing this module* parses every switch once (:func:`check_all`), whatever the
backend or code path will read later: a bad value (e.g. ``FDFLEET_DIRECT_LAUNCH`` under the Triton
interpreter, which never launches directly) raises ``ValueError`` at import instead of passing
unnoticed. The import also logs one WARNING per process for each ``FDFLEET_*`` name in the
environment that is not in the registry (a misspelt switch is otherwise silently ignored), naming
the closest known name when there is one (:func:`warn_unknown`). The CLI parses every switch again
before any command (``fdfleet --help`` still prints with a bad value).

A new variable gets a :class:`Variable` in :data:`VARIABLES` and a row in README's "Environment
variables" table (default and meaning): ``tests/test_hostile_process.py`` checks that every
``FDFLEET_*`` name in this file is there.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

TRUE_VALUES: tuple[str, ...] = ("1", "true", "yes", "on")
FALSE_VALUES: tuple[str, ...] = ("0", "false", "no", "off")
BACKENDS: tuple[str, ...] = ("auto", "reference", "triton")
LOG_LEVELS: dict[str, int] = {
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARNING": logging.WARNING,
    "ERROR": logging.ERROR,
    "CRITICAL": logging.CRITICAL,
}


def parse_bool(name: str, value: str | bool) -> bool:
    """Parse ``value`` of variable ``name``: ``1/true/yes/on`` or ``0/false/no/off`` (any case)."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {type(value).__name__} {value!r}")
    v = value.strip().lower()
    if v in TRUE_VALUES:
        return True
    if v in FALSE_VALUES:
        return False
    raise ValueError(f"{name}={value!r} is not a boolean; use one of {', '.join(TRUE_VALUES + FALSE_VALUES)}")


def _raw(name: str) -> str | None:
    """The stripped value of ``name``, or ``None`` when unset or empty."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return None
    return value


def raw_values(*names: str) -> tuple[str | bytes | None, ...]:
    """The unparsed values of ``names`` (``None`` where unset), for cache keys only: something built
    under one value is built again when it changes, and parses the value strictly where it uses it
    (:func:`raw_reader`'s values, read once; per call paths keep a :func:`raw_reader`)."""
    return raw_reader(*names)()


def raw_reader(*names: str):
    """A function of no arguments returning the unparsed values of ``names`` (``None`` where unset), read
    from ``os.environ``'s own mapping where it has one (its encoded keys: one dict lookup per name
    instead of ``os.environ.get``'s Python frames): the names encoded once,
    ``os.environ``'s mapping looked up again only when ``os.environ`` is another object (the one-shot
    kernel wrappers read their switches on every call: ~0.1 us for three names instead of ~0.8)."""
    seen = env_get = None
    keys = names

    def bind() -> None:
        nonlocal seen, env_get, keys
        env = os.environ
        data = getattr(env, "_data", None)
        if type(data) is dict:
            env_get, keys = data.get, tuple(env.encodekey(n) for n in names)
        else:  # another mapping: its own lookup by name
            env_get, keys = env.get, names
        seen = env

    if len(names) == 3:  # unrolled (3 and 4 names): a comprehension costs ~0.25 us more

        def read() -> tuple:
            if os.environ is not seen:
                bind()
            get = env_get
            return (get(keys[0]), get(keys[1]), get(keys[2]))
    elif len(names) == 4:

        def read() -> tuple:
            if os.environ is not seen:
                bind()
            get = env_get
            return (get(keys[0]), get(keys[1]), get(keys[2]), get(keys[3]))
    else:

        def read() -> tuple:
            if os.environ is not seen:
                bind()
            return tuple(map(env_get, keys))

    return read


def get_bool(name: str, default: bool) -> bool:
    """Boolean variable ``name`` (``default`` when unset or empty)."""
    value = _raw(name)
    return default if value is None else parse_bool(name, value)


def _choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """Variable ``name`` as one of ``choices`` (case-insensitive; ``default`` when unset or empty)."""
    value = _raw(name)
    if value is None:
        return default
    v = value.strip().lower()
    if v not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}")
    return v


def backend_name() -> str:
    """``FDFLEET_BACKEND``: which attention backend to use (default ``auto``)."""
    return _choice("FDFLEET_BACKEND", BACKENDS, "auto")


def headwise_kv() -> bool:
    """``FDFLEET_HEADWISE_KV``: use head-wise KV pages with sliding-window recycling (default off)."""
    return get_bool("FDFLEET_HEADWISE_KV", False)


def log_level() -> int:
    """``FDFLEET_LOG_LEVEL`` as a ``logging`` level number (default ``logging.WARNING``)."""
    value = _raw("FDFLEET_LOG_LEVEL")
    if value is None:
        return logging.WARNING
    level = LOG_LEVELS.get(value.strip().upper())
    if level is None:
        raise ValueError(f"FDFLEET_LOG_LEVEL={value!r} is not one of {', '.join(LOG_LEVELS)}")
    return level


MODEL_IMPL_VAR = "FDFLEET_MODEL_IMPL"


def model_impl_is_paddlefleet() -> bool:
    """``FDFLEET_MODEL_IMPL``: whether ``--model-impl paddlefleet`` was chosen (unset: no)."""
    value = _raw(MODEL_IMPL_VAR)
    if value is None:
        return False
    if value.strip().lower() != "paddlefleet":
        raise ValueError(f"{MODEL_IMPL_VAR}={value!r} is not 'paddlefleet' (the plugin sets it; unset it)")
    return True


PREFILL_KERNELS: tuple[str, ...] = ("auto", "hopper", "portable")


def prefill_kernel() -> str:
    """``FDFLEET_PREFILL_KERNEL``: ``auto`` (default: the Hopper Gluon kernel on sm_90 when it can run
    the inputs and the installed Triton is a release it was tested on, else the portable Triton one:
    ``kernels/hopper_support.py``), ``hopper`` (required; an error if it cannot run, or does not compile
    with the installed Triton) or ``portable`` (always the portable Triton kernel)."""
    return _choice("FDFLEET_PREFILL_KERNEL", PREFILL_KERNELS, "auto")


KV_RECYCLE_MODES: tuple[str, ...] = ("auto", "off")


def kv_recycle() -> str:
    """``FDFLEET_KV_RECYCLE``: ``auto`` (default: window recycling inside FastDeploy's scheduler and
    runner wherever the plan has sliding windows or heads) or ``off`` (every layer keeps every block)."""
    return _choice("FDFLEET_KV_RECYCLE", KV_RECYCLE_MODES, "auto")


def direct_launch() -> bool:
    """``FDFLEET_DIRECT_LAUNCH``: launch the Triton kernels' compiled launchers directly after their first
    call, skipping Triton's per-call argument binding (default on; ``kernels/launch/direct.py``). Off: every
    launch goes through ``kernel[grid](...)``."""
    return get_bool("FDFLEET_DIRECT_LAUNCH", True)


def own_launcher() -> bool:
    """``FDFLEET_OWN_LAUNCHER``: direct launches go through the plugin's own launcher (one struct pack and
    one ``cuLaunchKernel``; ``kernels/launch/own_launcher.py``) where it reproduces Triton's launch exactly
    (default on). Off: through the compiled kernel's Triton launcher."""
    return get_bool("FDFLEET_OWN_LAUNCHER", True)


def fused_decode_write() -> bool:
    """``FDFLEET_FUSED_DECODE_WRITE``: in a step where every request decodes one token, the Triton
    backend's decode launch writes the step's K/V into the cache itself: one launch per layer instead
    of the cache write's and the decode's, for hosts that launch eagerly (default off: on the H200 the
    fused decode ran 2.5 % longer than the decode alone at 64 x 4096, more than the separate write
    costs inside a CUDA graph; ``benchmarks/NOTES.md``)."""
    return get_bool("FDFLEET_FUSED_DECODE_WRITE", False)


def decode_key_rows() -> bool:
    """``FDFLEET_DECODE_KEY_ROWS``: decode over a block_wise_fp8 KV cache takes the key tiles as the dots'
    rows (``kernels/attention_kernels._tile_key_rows``) where that was timed faster
    (``kernels/paged_attention.key_rows_by_default``: 1.49x our bf16 decode against 1.33x at 64 x 4096 on an
    H100, ``benchmarks/NOTES.md``); off: the query-rows layout everywhere. Default on."""
    return get_bool("FDFLEET_DECODE_KEY_ROWS", True)


DEQUANT_SCRATCH_MB_DEFAULT = 512


def dequant_scratch_mb() -> int:
    """``FDFLEET_DEQUANT_SCRATCH_MB``: the most memory (MiB) the Hopper prefill of a quantized KV cache may
    take for its bf16 / fp16 scratch (``kernels/kv_dequant_gather.py``; one per head geometry, shared
    by its layers, allocated whole at the first prefill), default 512. A step whose bound is larger runs
    the portable prefill over the codes instead, as ``0`` makes every step do (no scratch at all)."""
    name = "FDFLEET_DEQUANT_SCRATCH_MB"
    value = _raw(name)
    if value is None:
        return DEQUANT_SCRATCH_MB_DEFAULT
    v = value.strip()
    if not v.isdigit() or not v.isascii():
        raise ValueError(f"{name}={value!r} is not a whole number of MiB (0 or more)")
    return int(v)


@dataclass(frozen=True)
class Variable:
    """One ``FDFLEET_*`` variable: its ``name``, the getter that parses it (``read``: the value, or
    ``ValueError`` naming the variable and the bad value; ``None`` for a test / CI variable that holds
    a path and is read where it is used), its ``default`` as README states it and a one-line ``doc``."""

    name: str
    read: Callable[[], Any] | None
    default: str
    doc: str

    @property
    def parsed(self) -> bool:
        return self.read is not None


#: every FDFLEET_* variable, by name: the one registry (check_all, warn_unknown, README's table)
VARIABLES: dict[str, Variable] = {
    v.name: v
    for v in (
        Variable("FDFLEET_BACKEND", backend_name, "auto", "attention backend: auto, reference, triton"),
        Variable("FDFLEET_HEADWISE_KV", headwise_kv, "off", "head-wise KV pages with window recycling"),
        Variable("FDFLEET_PREFILL_KERNEL", prefill_kernel, "auto", "prefill kernel: auto, hopper, portable"),
        Variable("FDFLEET_KV_RECYCLE", kv_recycle, "auto", "window recycling in FastDeploy: auto, off"),
        Variable("FDFLEET_DIRECT_LAUNCH", direct_launch, "on", "launch compiled Triton kernels directly"),
        Variable("FDFLEET_OWN_LAUNCHER", own_launcher, "on", "direct launches through the plugin's launcher"),
        Variable("FDFLEET_FUSED_DECODE_WRITE", fused_decode_write, "off", "decode launch writes the K/V"),
        Variable("FDFLEET_DECODE_KEY_ROWS", decode_key_rows, "on", "fp8 decode: key tiles as rows"),
        Variable(
            "FDFLEET_DEQUANT_SCRATCH_MB", dequant_scratch_mb, "512", "quantized caches' prefill scratch (MiB)"
        ),
        Variable("FDFLEET_LOG_LEVEL", log_level, "WARNING", "the plugin's log level"),
        Variable(MODEL_IMPL_VAR, model_impl_is_paddlefleet, "unset", "set by --model-impl paddlefleet"),
        Variable("FDFLEET_HOST_FASTDEPLOY", None, "unset", "tests only: FastDeploy's sources"),
        Variable("FDFLEET_HOST_PADDLEFLEET", None, "unset", "tests only: PaddleFleet's sources"),
        Variable("FDFLEET_TRITON36_SITE", None, "/tmp/tr36site", "tests only: a Triton 3.6 site folder"),
    )
}

#: every parsed switch's getter (check_all runs them all)
_GETTERS: tuple[Callable[[], Any], ...] = tuple(v.read for v in VARIABLES.values() if v.read is not None)

PREFIX = "FDFLEET_"


def check_all() -> None:
    """Parse every switch now: ``ValueError`` naming the first bad variable and its value."""
    for getter in _GETTERS:
        getter()


#: unknown names already warned about in this process (one WARNING each)
_warned: set[str] = set()


def unknown_names(environ: Any = None) -> list[str]:
    """The ``FDFLEET_*`` names set in ``environ`` (default ``os.environ``) that no :class:`Variable`
    declares, sorted."""
    env = os.environ if environ is None else environ
    return sorted(n for n in env if n.startswith(PREFIX) and n not in VARIABLES)


def unknown_message(name: str) -> str:
    """What :func:`warn_unknown` says about ``name``: the closest known name, or that there is none."""
    close = difflib.get_close_matches(name, list(VARIABLES), n=1, cutoff=0.75)
    known = ", ".join(VARIABLES)
    hint = f"did you mean {close[0]}?" if close else f"no known variable is close (known: {known})"
    return f"{name} is not a known fastdeploy-paddlefleet variable and is ignored; {hint}"


def warn_unknown(environ: Any = None) -> list[str]:
    """Log one WARNING per process for each unknown ``FDFLEET_*`` name in ``environ``; the names
    warned about now."""
    fresh = [n for n in unknown_names(environ) if n not in _warned]
    for name in fresh:
        _warned.add(name)
        logger.warning("%s", unknown_message(name))
    return fresh


# at import: every switch parsed (a bad value raises here, whatever backend reads it later), then
# one warning per misspelt name
check_all()
warn_unknown()
