"""``fdfleet verify``: run the same requests through a model's own attention and the paged path, compare.

The model is minifleet (``--preset``, default ``tiny``, or a minifleet
``--config``), a PaddleFleet model built through PaddleFormers from a
``--config`` of another ``model_type`` (random init; needs ``paddlefleet``),
a small PaddleFormers model (``--paddleformers ARCH``), or a checkpoint
directory on its real weights (``--model DIR``: a minifleet model directory or
a PaddleFormers checkpoint, ``runner.checkpoint_case``).
``--headwise-kv`` (default: ``FDFLEET_HEADWISE_KV``) allocates the KV cache in
head-wise pages with sliding-window recycling; released pages are NaN-filled.
``--kv-cache-quant TYPE`` (FastDeploy's ``kv_cache_quant_type``: ``block_wise_fp8``;
``float8_e4m3fn`` / ``int8`` with scales calibrated on the verify prompts) runs the same schedule
again on a quantized cache, fed the same tokens, and reports its error against the unquantized
run: top-1 agreement and max / mean logit error (``runner.kv_quant_compare``).
Exit code 0 when every compared logit is within ``--tolerance`` and greedy
decoding agrees everywhere (and, with ``--kv-cache-quant``, the quantized run is finite and within
``--quant-min-top1`` / ``--quant-max-mean-error``), 1 otherwise, 2 on bad input: a config whose weights
cannot fit in the available memory included (``plan.weights.check_fits``: the
estimate and ``MemAvailable`` named, nothing allocated).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from typing import Any

from ..presets import minifleet_presets
from . import CliError, about, float_arg, int_arg, missing_extra

PADDLEFORMERS_CASES = "fastdeploy_paddlefleet.runner.paddleformers_case"


def add_parser(subparsers: Any) -> None:
    try:
        from ..runner.paddleformers_case import ARCHITECTURES  # stdlib and the plan only: cheap
    except ModuleNotFoundError:  # a build without it: --paddleformers then says so by name when used
        ARCHITECTURES = ()  # noqa: N806
    architectures = ", ".join(sorted(ARCHITECTURES)) or "none in this build"
    p = subparsers.add_parser(
        "verify",
        help="compare the patched paged attention with the model's own attention (logits, greedy tokens)",
        description=__doc__.splitlines()[0],
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--preset",
        default=None,
        help=f"minifleet preset name (default tiny; one of {', '.join(minifleet_presets())})",
    )
    src.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="a checkpoint directory (config.json + *.safetensors): a minifleet model directory "
        "(fdfleet modeldir; model_type minifleet) or a PaddleFormers checkpoint (save_pretrained) "
        f"of model_type {architectures} (the paddleformers extra), verified on "
        "its real weights; a loading bar over its weight files on a terminal",
    )
    src.add_argument(
        "--config",
        default=None,
        help="config.json of a minifleet model (model_type minifleet), or of a PaddleFleet model "
        "built through PaddleFormers (other model types; needs paddlefleet)",
    )
    p.add_argument(
        "--backend",
        default=None,
        choices=("auto", "reference", "triton"),
        help="attention backend (default: FDFLEET_BACKEND, else auto = triton on GPU, reference on CPU)",
    )
    p.add_argument(
        "--steps",
        type=int_arg(0, 65536),
        default=8,
        help="decode steps per request after the prefill (default 8)",
    )
    p.add_argument(
        "--seed",
        type=int_arg(0, 2**32 - 1),
        default=0,
        help="seed of the weights and the prompts (default 0)",
    )
    p.add_argument(
        "--tolerance", type=float_arg(0, 1e30), default=1e-4, help="max abs logit difference (default 1e-4)"
    )
    p.add_argument(
        "--chunk-size", type=int_arg(1, 65536), default=8, help="prefill chunk size in tokens (default 8)"
    )
    p.add_argument(
        "--block-size", type=int_arg(1, 1024), default=4, help="tokens per KV cache block (default 4)"
    )
    p.add_argument(
        "--headwise-kv",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="head-wise KV pages with sliding-window recycling, released pages NaN-filled "
        "(default: FDFLEET_HEADWISE_KV, else off)",
    )
    p.add_argument(
        "--paddleformers",
        metavar="ARCH",
        default=None,
        help=f"verify a small PaddleFormers model instead ({architectures}); "
        "--config then names that architecture's config.json",
    )
    p.add_argument(
        "--kv-cache-quant",
        metavar="TYPE",
        type=_quant_arg,
        default=None,
        help="also run on a quantized KV cache and report its error against the unquantized one: "
        "block_wise_fp8 (FastDeploy's dynamic per token-head fp8), or a static format "
        "(float8_e4m3fn / cache_fp8 per kv head, int8 / cache_int8 per channel) whose scales are "
        "calibrated on the verify prompts themselves (in-sample; no checkpoint scales here); default none",
    )
    p.add_argument(
        "--quant-min-top1",
        type=float_arg(0, 1),
        default=None,
        help="with --kv-cache-quant: fail below this top-1 agreement with the unquantized cache "
        "(default 0.8)",
    )
    p.add_argument(
        "--quant-max-mean-error",
        type=float_arg(0, 1e30),
        default=None,
        help="with --kv-cache-quant: fail when the mean |dlogit| exceeds this fraction of the mean "
        "unquantized |logit| (default 0.15)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run)


def _quant_arg(text: str) -> Any:
    """``--kv-cache-quant``: a served ``kv_cache_quant_type`` (or None for none); refused and unknown
    formats named by ``kvcache.quant.kv_cache_quant``."""
    from ..kvcache.quant import kv_cache_quant

    try:
        return kv_cache_quant(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _backend(name: str | None) -> Any:
    from ..backends import get_backend

    if name is None:
        try:
            from ..envs import backend_name
        except ModuleNotFoundError:  # envs is optional here
            name = "auto"
        else:
            name = backend_name()
    try:
        backend = get_backend(name)
    except ModuleNotFoundError as e:
        raise (missing_extra(e, f"attention backend {name!r}") or e) from e
    except ImportError as e:
        raise CliError(f"attention backend {name!r} is not available: {e}") from e
    if getattr(backend, "name", None) == "triton" and _triton_interpreter():
        from ..kernels import _framework

        if _framework.torch is None:
            # Triton's CPU interpreter copies every tensor argument through torch's storage API
            # (untyped_storage / set_): paddle tensors cannot run there, only on a GPU
            raise CliError(
                f"--backend {name} under the Triton CPU interpreter (TRITON_INTERPRET=1) needs torch, which "
                "is not installed: install this package's 'torch' extra (pip install -e '.[torch]'); "
                "on a GPU the kernels take paddle tensors without torch"
            )
    return backend


def _triton_interpreter() -> bool:
    """Whether ``TRITON_INTERPRET`` turns on Triton's CPU interpreter (Triton's own truthy spellings)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on", "y")


def _paddleformers_case(args: Any, backend: Any) -> Any:
    try:
        module = importlib.import_module(PADDLEFORMERS_CASES)
        return module.build_case(args.paddleformers, args.config, backend, args.seed)
    except ModuleNotFoundError as e:
        if e.name == PADDLEFORMERS_CASES:
            raise CliError(f"--paddleformers needs {e.name!r}, which is not installed in this build") from e
        raise (missing_extra(e, "--paddleformers") or e) from e
    except (ValueError, TypeError) as e:  # about the config file when it names it, else the ARCH
        if args.config and args.config in str(e):
            raise about("--config", args.config, e) from e
        raise about("--paddleformers", args.paddleformers, e) from e


def _checkpoint_case(model_dir: str, backend: Any, seed: int, progress: bool = False) -> Any:
    """``--model DIR``: the checkpoint's own eager forward against the patched model, real weights."""
    try:
        from ..runner.checkpoint_case import build_checkpoint_case

        return build_checkpoint_case(model_dir, backend, seed, progress=progress)
    except ModuleNotFoundError as e:
        raise (missing_extra(e, "--model") or e) from e
    except (ValueError, TypeError) as e:
        raise about("--model", model_dir, e) from e


def _headwise_kv(flag: bool | None) -> bool:
    if flag is not None:
        return flag
    from ..envs import headwise_kv

    return headwise_kv()  # ValueError naming FDFLEET_HEADWISE_KV on a bad value


def _paddlefleet_installed() -> bool:
    return importlib.util.find_spec("paddlefleet") is not None


def _minifleet_config(args: Any) -> Any:
    """The minifleet config to build (a name or a raw dict); a PaddleFleet config's raw dict is
    returned as ``("paddlefleet", raw)``, with a clear error when ``paddlefleet`` is missing."""
    from ..minifleet.config import load_raw_config

    if args.config is None:
        name = args.preset or "tiny"
        raw = load_raw_config(name)
        if raw.get("model_type", "minifleet") != "minifleet":
            raise CliError(
                f"--preset {name!r} is a {raw.get('model_type')!r} config, not a minifleet one "
                f"(minifleet presets: {', '.join(minifleet_presets())}; use `fdfleet plan` for the others)"
            )
        return name
    from ..plan import plan_from_config
    from ..plan.config import load_config
    from ..plan.fields import check_caps, check_numeric_fields

    try:
        raw = load_raw_config(load_config(args.config))
        model_type = raw.get("model_type", "minifleet")
        if model_type == "minifleet":
            # impossible sizes and invalid fields (rope_theta, layernorm_epsilon, ...) refused by
            # name before a model is built, not reported later as a parity failure
            plan_from_config(raw)
            return raw
        check_caps(raw)
        check_numeric_fields(raw)
    except (ValueError, TypeError) as e:
        raise about("--config", args.config, e) from e
    if not _paddlefleet_installed():
        raise CliError(
            f"--config {args.config!r} is a PaddleFleet model config (model_type {model_type!r}); "
            "building it through PaddleFormers needs the `paddlefleet` package, which is not installed. "
            "Use a minifleet config (model_type minifleet), --preset, or --paddleformers ARCH"
        )
    return ("paddlefleet", raw)


def _check_config_fits(args: Any) -> None:
    """``--config FILE`` (any verify path that builds from it): refuse a model whose two instances'
    weights cannot fit in the available memory, naming the estimate and the memory (exit 2), before
    anything heavy is imported or allocated. Other faults of the file are left to the path that
    reads it (its own messages); the builders check the fit again with the dtype they build in."""
    if not args.config:
        return
    from ..plan.config import load_config
    from ..plan.weights import ModelTooLargeError, check_fits

    try:
        raw = load_config(args.config)
        if raw.get("model_type", "minifleet") == "minifleet":
            check_fits(raw, copies=2, dtype="float32", what="the model of this config")
        else:  # PaddleFleet / PaddleFormers: the config's dtype, two instances
            check_fits(raw, copies=2, what="the model of this config")
    except ModelTooLargeError as e:
        raise about("--config", args.config, e) from e
    except (ValueError, TypeError, AttributeError):
        return  # named by the path that builds it


def _print_table(report: Any) -> None:
    hw = report.headwise_kv
    print(
        f"{report.name} backend={report.backend} layers patched={report.layers_patched}"
        + (f" head-wise KV pages={report.pages_total}" if hw else "")
    )
    print(
        f"{'step':>4} {'tokens':>6} {'prefill':>7} {'decode':>6} {'max|dlogit|':>12} {'greedy':>7} "
        f"{'blocks':>6}"
        + (f" {'pages':>6} {'freed':>6}" if hw else "")
        + f" {'ms':>8}"
        + (f" {'quant|dlogit|':>13} {'q-top1':>6}" if report.quant is not None else "")
    )
    for s in report.steps:
        greedy = f"{s.greedy_matches}/{s.greedy_total}" if s.greedy_total else "-"
        pages = f" {s.pages_used:>6} {s.pages_released:>6}" if hw else ""
        quant = ""
        if s.quant_max_abs_logit_error is not None:
            top1 = f"{s.quant_top1_matches}/{s.num_tokens}"
            quant = f" {s.quant_max_abs_logit_error:>13.3e} {top1:>6}"
        print(
            f"{s.step:>4} {s.num_tokens:>6} {s.num_prefill:>7} {s.num_decode:>6} "
            f"{s.max_abs_logit_diff:>12.3e} {greedy:>7} {s.blocks_used:>6}{pages} {1000 * s.seconds:>8.1f}"
            + quant
        )
    if hw:
        print(f"head-wise KV: {report.pages_released} pages released by the window rule (NaN-filled)")
    q = report.quant
    if q is not None:  # two comparisons: say which is which
        verdict_paged = "passed" if report.paged_passed else "FAILED"
        print(
            f"paged vs native attention ({verdict_paged}): max abs logit diff "
            f"{report.max_abs_logit_diff:.3e} (tolerance {report.tolerance:g}), greedy agreement "
            f"{100 * report.greedy_agreement:.1f}%"
        )
        print(
            f"{q.kv_cache_quant} KV cache vs the same paged run on a {q.reference_dtype} cache, same tokens "
            f"({'passed' if q.passed else 'FAILED'}): top-1 agreement {100 * q.top1_agreement:.1f}% of "
            f"{q.positions} positions ({100 * q.greedy_top1_agreement:.1f}% of {q.greedy_positions} greedy "
            f"picks), max |dlogit| {q.max_abs_logit_error:.3e} ({100 * q.rel_logit_error:.2f}% of the "
            f"largest |logit| {q.max_abs_logit:.3g}), mean {q.mean_abs_logit_error:.3e} "
            f"({100 * q.mean_rel_error:.2f}% of the mean |logit|); bounds: top-1 >= "
            f"{q.min_top1_agreement:g}, mean |dlogit| <= {q.max_mean_rel_error:g} of the mean |logit|"
        )
        if q.calibration:
            print(f"  static scales: {q.calibration}")
        for why in q.failures:
            print(f"  failure: {why}")
    verdict = "PASSED" if report.passed else "FAILED"
    print(
        f"{verdict}: max abs logit diff {report.max_abs_logit_diff:.3e} (tolerance {report.tolerance:g}), "
        f"greedy agreement {100 * report.greedy_agreement:.1f}%, {len(report.steps)} steps, "
        f"{report.seconds:.1f} s"
    )


def run(args: Any) -> int:
    from ..runner import fleet_case
    from ..runner import verify as driver

    if args.steps < 0:
        raise CliError(f"--steps must be >= 0, got {args.steps}")
    headwise_kv = _headwise_kv(getattr(args, "headwise_kv", None))
    quant = getattr(args, "kv_cache_quant", None)
    for flag, value in (
        ("--quant-min-top1", "quant_min_top1"),
        ("--quant-max-mean-error", "quant_max_mean_error"),
    ):
        if getattr(args, value, None) is not None and quant is None:
            raise CliError(f"{flag} needs --kv-cache-quant")
    _check_config_fits(args)  # before paddle is imported: a huge config is refused at once
    backend = _backend(args.backend)
    if args.paddleformers:
        for flag, value in (("--preset", args.preset), ("--model", getattr(args, "model", None))):
            if value:
                raise CliError(f"--paddleformers and {flag} cannot be combined")
        case = _paddleformers_case(args, backend)
    elif getattr(args, "model", None) is not None:
        case = _checkpoint_case(args.model, backend, args.seed, not args.json and sys.stderr.isatty())
    else:
        from ..plan.weights import ModelTooLargeError

        config = _minifleet_config(args)
        try:  # a config too large for memory is refused before a byte is allocated (exit 2)
            if isinstance(config, tuple):
                case = fleet_case.build_paddlefleet_case(config[1], backend, args.seed, name=args.config)
            else:
                case = fleet_case.build_minifleet_case(config, backend, args.seed)
        except ModelTooLargeError as e:
            raise about("--config" if args.config else "--preset", args.config or args.preset, e) from e
    report = driver.run_verify(
        case,
        decode_steps=args.steps,
        chunk_size=args.chunk_size,
        block_size=args.block_size,
        seed=args.seed,
        tolerance=args.tolerance,
        progress=not args.json and sys.stderr.isatty(),  # no carriage returns in logs
        headwise_kv=headwise_kv,
        kv_cache_quant=quant,
        min_top1_agreement=getattr(args, "quant_min_top1", None),
        max_mean_rel_error=getattr(args, "quant_max_mean_error", None),
    )
    if args.json:
        json.dump(report.to_dict(), sys.stdout)
        sys.stdout.write("\n")
    else:
        _print_table(report)
    return 0 if report.passed else 1
