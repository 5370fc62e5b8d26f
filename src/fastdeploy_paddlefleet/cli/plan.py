"""``fdfleet plan SOURCE``: show a model's per-layer attention plan and KV budget.

SOURCE is a ``config.json`` path, a model directory, or a preset name
(``fdfleet plan tiny``). Imports nothing heavy.

Ranges in the tables include both ends (heads ``0-3`` are heads 0, 1, 2 and
3; layers ``0-22/2`` are every 2nd layer from 0 to 22); ``--json`` keeps the
plan's own half-open ``[start, stop)`` lists. Below the tables, one
``WARNING:`` line per thing serving will refuse or cannot do (a checkpoint's
``quantization_config``; a rank that cannot hold one request, with the
``--tp`` that would; a window-recycling pool too small for one
``--max-model-len`` request).

``--context`` takes a comma-separated mix of request lengths (``256,2048,8192``): the window
recycling report prints one row per length (FastDeploy's max concurrent requests beside
recycling's, in the same bytes); the per-layer KV budget tables use the LONGEST of them.
``--max-model-len`` (default: the longest ``--context``) is what the engine must hold one request
of; a ``--context`` longer than it is refused (FastDeploy admits no such request).

``--kv-cache-quant TYPE`` (FastDeploy's ``kv_cache_quant_type``: ``block_wise_fp8``,
``float8_e4m3fn`` / ``cache_fp8``, ``int8`` / ``cache_int8``; default none) counts a quantized cache:
one byte per element plus, for ``block_wise_fp8``, a K and a V scale per token and kv head in
``--dtype`` (the model dtype). ``--dtype fp8`` / ``int8`` is refused with a pointer to it:
FastDeploy's ``--dtype`` is the model's dtype and a quantized cache is chosen by
``kv_cache_quant_type``, whose formats differ in bytes (dynamic scales) and in what they need
(calibrated checkpoint scales), so an alias would have to guess.

The window recycling report names the ``FDFLEET_KV_RECYCLE`` value in effect and where it came
from (the environment or the default); ``off`` shows what recycling would give. Last, the
"FastDeploy flags" section (``--json``: ``fastdeploy_flags``) gives the command line serving the
planned configuration: ``--num-gpu-blocks-override`` (the memory at the serving side's price per
block, ``kvcache.pools``), ``--max-num-seqs`` (the requests of the shortest ``--context`` held at
once, within FastDeploy's ``[1, 512]``), ``--block-size``, ``--max-model-len``,
``--max-num-batched-tokens``, ``--tensor-parallel-size``, ``--quantization`` (``mix_quant`` with
``kv_cache_quant_type``) for ``--kv-cache-quant``, ``FD_PLUGINS=paddlefleet`` and ``--model-impl
paddlefleet``. The figures README and the docs quote are generated from the same functions
(``cli/figures.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any

from ..kvcache.layout import GIB, KVBudget, format_bytes, kv_budget
from ..kvcache.pools import PoolLayout, budget_blocks, capacity
from ..kvcache.quant import ALIASES, FORMATS, kv_cache_quant
from ..plan import AttentionPlan, LayerAttention, load_config, plan_from_config
from ..presets import list_presets
from ..serving.cache_views import uniform_budget, uniform_cost
from ..serving.checks import check_quantization
from ..serving.kv_recycling.protocol import layout_from_plans, merge_tp_plans
from ..serving.kv_recycling.report import (
    NOTHING_TO_RECYCLE,
    REPORT_BATCHED_TOKENS,
    PoolsReport,
    check_contexts,
    format_pools,
    pools_for,
)
from . import CliError, about, float_arg, int_arg

#: tensor-parallel sizes tried for the ``--tp`` hint when one rank cannot hold a request
TP_HINTS: tuple[int, ...] = (2, 4, 8, 16, 32, 64)
#: printed under every table: the range notation of all of them
RANGE_NOTE = "(ranges a-b include both ends: heads 0-3 = 4 heads; a-b/s: every s-th layer from a to b)"
#: the most tokens a --context / --max-model-len may ask for (int32 sequence lengths)
MAX_CONTEXT = 2**31 - 1

LAYER_KEYS = (
    "index",
    "kind",
    "num_q_heads",
    "num_kv_heads",
    "qk_head_dim",
    "v_head_dim",
    "window_left",
    "sliding_kv_heads",
    "sink",
    "softmax_scale",
    "mla",
)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="show the per-layer attention plan and KV cache budget of a config or preset",
        description="Show the per-layer attention plan and KV cache budget of a config or preset.",
    )
    presets = ", ".join(list_presets())
    p.add_argument(
        "source", metavar="SOURCE", help=f"config.json path, model directory or preset ({presets})"
    )
    p.add_argument("--tp", type=int_arg(1, 65536), default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--tp-rank", type=int_arg(0, 65535), default=0, help="which rank to show (default 0)")
    p.add_argument(
        "--block-size", type=int_arg(1, 2**20), default=64, help="tokens per KV block (default 64)"
    )
    p.add_argument(
        "--dtype",
        default="bf16",
        help="model (and unquantized KV cache) dtype: bf16, fp16, fp32 (default bf16); a quantized "
        "cache is --kv-cache-quant",
    )
    p.add_argument(
        "--kv-cache-quant",
        type=kv_quant_arg,
        default=None,
        metavar="TYPE",
        help="FastDeploy's kv_cache_quant_type: none (default), "
        + ", ".join(FORMATS)
        + "; also "
        + ", ".join(k for k in ALIASES if k not in FORMATS)
        + " (codes 1 byte, block_wise_fp8 adds a K and a V scale per token and kv head in --dtype)",
    )
    p.add_argument(
        "--memory-gib",
        type=float_arg(0, 2**20, low_open=True),
        default=40.0,
        help="KV cache memory per rank in GiB (default 40)",
    )
    p.add_argument(
        "--context",
        type=context_list,
        default=(8192,),
        metavar="N[,N...]",
        help="request lengths in tokens, comma-separated (e.g. 256,2048,8192; default 8192): one row "
        "each in the recycling report; the per-layer KV budget uses the longest",
    )
    p.add_argument(
        "--max-model-len",
        type=int_arg(1, MAX_CONTEXT),
        default=None,
        help="longest request the engine must hold one of (default: the longest --context; "
        "no --context may exceed it)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int_arg(1, MAX_CONTEXT),
        default=REPORT_BATCHED_TOKENS,
        help=f"FastDeploy's tokens per step; recycling keeps one step's prefill chunk free "
        f"(default {REPORT_BATCHED_TOKENS})",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=run)


#: --dtype values that are a quantized cache, not a model dtype: refused with a pointer
QUANT_DTYPES = ("fp8", "int8", "float8", "float8_e4m3fn", "uint8", "cache_fp8", "cache_int8")


def model_dtype(text: str) -> str:
    """``--dtype``: a float dtype the KV budget knows; ``fp8`` / ``int8`` refused with a pointer to
    ``--kv-cache-quant`` (:class:`CliError` naming ``--dtype``)."""
    from ..kvcache.layout import DTYPE_BYTES

    name = str(text).strip().lower()
    if name in QUANT_DTYPES:
        raise CliError(
            f"--dtype {text}: "
            f"{text!r} is a quantized KV cache, which FastDeploy selects with kv_cache_quant_type, not "
            "--dtype (the model dtype): use --dtype bf16 --kv-cache-quant block_wise_fp8 (dynamic "
            "fp8, no calibration), float8_e4m3fn or int8 (static, the checkpoint's scales)"
        )
    if name not in DTYPE_BYTES:
        known = ", ".join(k for k in DTYPE_BYTES if DTYPE_BYTES[k] > 1)
        raise CliError(f"--dtype: unknown dtype {text!r}; expected one of {known}")
    return name


def kv_quant_arg(text: str) -> str | None:
    """An argparse ``type`` for ``--kv-cache-quant``: FastDeploy's name of a served format (its
    canonical name), ``None`` for ``none``; refused formats are named with the reason."""
    try:
        fmt = kv_cache_quant(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return None if fmt is None else fmt.name


def context_list(text: str) -> tuple[int, ...]:
    """An argparse ``type``: comma-separated request lengths, each an int in ``[1, MAX_CONTEXT]``,
    none twice (argparse names ``--context`` on error)."""
    parse = int_arg(1, MAX_CONTEXT)
    items = text.split(",")
    values: list[int] = []
    for item in items:
        if len(items) > 1 and not item.strip():
            raise argparse.ArgumentTypeError(f"an empty length in {text!r}: expected e.g. 256,2048,8192")
        try:
            value = parse(item.strip())
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e} in {text!r}" if len(items) > 1 else str(e)) from None
        if value in values:
            raise argparse.ArgumentTypeError(f"{value} is given twice in {text!r}")
        values.append(value)
    return tuple(values)


def layer_dict(layer: LayerAttention) -> dict[str, Any]:
    """The ``--json`` view of one layer: ``LAYER_KEYS``, plus ``logits_soft_cap`` on a layer that caps."""
    d = {key: getattr(layer, key) for key in LAYER_KEYS}
    d["sliding_kv_heads"] = list(layer.sliding_kv_heads) if layer.sliding_kv_heads else None
    d["mla"] = dataclasses.asdict(layer.mla) if layer.mla is not None else None
    if layer.logits_soft_cap is not None:
        d["logits_soft_cap"] = layer.logits_soft_cap
    return d


def plan_json(
    source: str, plan: AttentionPlan, budget: KVBudget, warnings: list[str] | None = None, pools: Any = None
) -> dict[str, Any]:
    return {
        "source": source,
        "convention": plan.convention,
        "layers": [layer_dict(layer) for layer in plan],
        "kv_cache": {**budget.to_dict(), "fastdeploy_uniform": uniform_budget(plan, budget)},
        "pools": pools if pools is None or isinstance(pools, str) else pools.to_dict(),
        "warnings": list(warnings or ()),
    }


def serving_refusals(raw: dict[str, Any]) -> list[str]:
    """What serving refuses at load time for this config (``serving.checks``' own messages):
    today a checkpoint's ``quantization_config``."""
    archs = raw.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else "the model"
    fd_config = {"model_config": {"quantization_config": raw.get("quantization_config")}}
    try:
        check_quantization(fd_config, arch)
    except ValueError as e:
        return [f"serving will refuse this checkpoint: {e}"]
    return []


def budget_context(args: argparse.Namespace) -> int:
    """The request length the per-layer KV budget tables use: the longest ``--context``."""
    return max(args.context)


def _fits(source: Any, tp: int, args: argparse.Namespace) -> tuple[int, int] | None:
    """``(max requests per-layer sizing, max requests in FastDeploy's one shape)`` at ``tp``;
    None when the heads do not split ``tp`` ways."""
    try:
        plan = plan_from_config(source, tp_size=tp, tp_rank=0)
    except ValueError:
        return None
    budget = kv_budget(
        plan, args.block_size, args.dtype, args.memory_gib, budget_context(args), args.kv_cache_quant
    )
    return budget.max_requests, uniform_budget(plan, budget)["max_requests_uniform"]


def capacity_warnings(raw: dict[str, Any], plan: AttentionPlan, budget: KVBudget, args: Any) -> list[str]:
    """A warning with a ``--tp`` hint when one rank cannot hold one longest ``--context`` request in
    FastDeploy's cache shape (what serving allocates), e.g. DeepSeek-V3 at TP 1 in 40 GiB."""
    uniform = uniform_budget(plan, budget)["max_requests_uniform"]
    if uniform >= 1:
        return []
    what = (
        f"one rank cannot hold one request of {budget_context(args)} tokens in {args.memory_gib:g} GiB "
        f"(max requests 0 in FastDeploy's one cache shape at --tp {plan.tp_size})"
    )
    for tp in (t for t in TP_HINTS if t > plan.tp_size):
        fits = _fits(raw, tp, args)
        if fits is not None and fits[1] >= 1:
            return [f"{what}; --tp {tp} holds {fits[1]} per rank: try --tp {tp}"]
    return [f"{what}, nor at any --tp up to {TP_HINTS[-1]}: give more --memory-gib or a shorter --context"]


def pools_warnings(pools: PoolsReport | str) -> list[str]:
    """A warning when window recycling's pool cannot hold one ``--max-model-len`` request (the
    engine refuses to start); nothing when it can, or when nothing slides."""
    if isinstance(pools, str) and pools != NOTHING_TO_RECYCLE:
        return [f"window recycling: {pools}"]
    return []


def format_indices(indices: list[int]) -> str:
    """``[0, 2, 4]`` -> ``0-4/2``; ``[0, 1, 2, 5]`` -> ``0-2,5``."""
    if len(indices) > 2:
        step = indices[1] - indices[0]
        if step > 1 and all(b - a == step for a, b in zip(indices, indices[1:], strict=False)):
            return f"{indices[0]}-{indices[-1]}/{step}"
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def span(start: int, stop: int) -> str:
    """The half-open ``[start, stop)`` in the tables' inclusive notation: ``(0, 4)`` -> ``0-3``,
    ``(2, 3)`` -> ``2``."""
    return str(start) if stop - start == 1 else f"{start}-{stop - 1}"


def _row(layer: LayerAttention, tp: bool, cap: bool = False) -> tuple[str, ...]:
    slide = "-" if layer.sliding_kv_heads is None else span(*layer.sliding_kv_heads)
    mla = "-"
    if layer.mla is not None:
        m = layer.mla
        mla = f"kv_lora {m.kv_lora_rank} nope {m.qk_nope_head_dim} rope {m.qk_rope_head_dim}"
    row = (
        layer.kind,
        f"{layer.num_q_heads}/{layer.num_kv_heads}",
        f"{layer.qk_head_dim}/{layer.v_head_dim}",
        "-" if layer.window_left is None else str(layer.window_left),
        slide,
        layer.sink,
        f"{layer.softmax_scale:.6g}",
        mla,
    )
    if cap:
        row += ("-" if layer.logits_soft_cap is None else f"{layer.logits_soft_cap:g}",)
    if tp:
        row += (span(*layer.q_head_range), span(*layer.kv_head_range))
    return row


def format_table(plan: AttentionPlan) -> str:
    """Per-layer table; identical layers share one row, listed by index (``0-22/2`` = every 2nd)."""
    tp = plan.tp_size > 1
    cap = any(layer.logits_soft_cap is not None for layer in plan)
    header = ("layers", "kind", "q/kv heads", "qk/v dim", "window_left", "sliding kv", "sink", "scale", "mla")
    if cap:
        header += ("soft cap",)
    if tp:
        header += ("q heads (sinks)", "kv heads")
    groups: dict[tuple[str, ...], list[int]] = {}
    for layer in plan:
        groups.setdefault(_row(layer, tp, cap), []).append(layer.index)
    rows = [header] + [(format_indices(idx),) + row for row, idx in groups.items()]
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.append(RANGE_NOTE)
    return "\n".join(lines)


def format_budget(b: KVBudget) -> str:
    sizes = sorted(set(b.bytes_per_token_per_layer))
    spread = format_bytes(sizes[0])
    if len(sizes) > 1:
        spread += f" to {format_bytes(sizes[-1])}"
    rows = [
        ("bytes/token", f"{format_bytes(b.bytes_per_token)} ({spread} per layer)"),
        (f"blocks in {b.memory_gib:g} GiB", f"{b.num_blocks} ({format_bytes(b.bytes_per_block)} per block)"),
        (
            "bytes/request",
            f"{format_bytes(b.bytes_per_request)} without recycling, "
            f"{format_bytes(b.bytes_per_request_recycled)} with sliding-window recycling",
        ),
        (
            "max requests",
            f"{b.max_requests} (every layer keeps every block, no look-ahead; FastDeploy's accounting "
            "and recycling's: the window recycling report)",
        ),
    ]
    what = b.dtype if b.kv_cache_quant is None else f"{b.kv_cache_quant} codes, {b.dtype} model"
    head = f"KV cache per rank ({what}, block {b.block_size}, {b.memory_gib:g} GiB, context {b.context}):"
    return "\n".join([head] + [f"  {label:<18} {value}" for label, value in rows])


def format_uniform(u: dict[str, Any], b: KVBudget) -> str:
    """FastDeploy's single cache shape (every layer sized like the largest) against per-layer sizing."""
    uniform, own = (
        format_bytes(u["bytes_per_token_uniform"]),
        format_bytes(u["bytes_per_token_per_layer_sizing"]),
    )
    rows = [
        ("shape", f"[blocks, {u['num_kv_heads']} kv heads, {b.block_size}, {u['head_dim']}] for K and V"),
        (
            "bytes/token",
            f"{uniform} vs {own} per-layer sizing "
            f"(x{u['overhead']:.2f}, +{format_bytes(u['extra_bytes_per_token'])})",
        ),
        (
            f"blocks in {b.memory_gib:g} GiB",
            f"{u['num_blocks_uniform']} vs {b.num_blocks}; max requests {u['max_requests_uniform']} "
            f"vs {b.max_requests} (no recycling)",
        ),
    ]
    head = "FastDeploy's one cache shape for every layer (what it allocates):"
    return "\n".join([head] + [f"  {label:<18} {value}" for label, value in rows])


#: FastDeploy's ``FDConfig.check``: ``1 <= max_num_seqs <= 512``
FASTDEPLOY_MAX_NUM_SEQS = 512
#: the ``FDFLEET_KV_RECYCLE`` values (``envs.KV_RECYCLE_MODES``)
RECYCLE_VAR = "FDFLEET_KV_RECYCLE"


def recycle_setting() -> tuple[str, str]:
    """``(value, source)``: the ``FDFLEET_KV_RECYCLE`` value in effect (``envs.kv_recycle``, strict
    parsing: ``ValueError`` naming the variable and the value) and where it came from, ``env`` or
    ``default`` (unset or empty)."""
    from .. import envs

    value = envs.kv_recycle()
    raw = os.environ.get(RECYCLE_VAR)
    return value, "env" if raw is not None and raw.strip() else "default"


@dataclasses.dataclass(frozen=True)
class FastDeployFlags:
    """What to pass FastDeploy for the planned configuration (one rank's KV memory).

    ``num_gpu_blocks_override``: the blocks ``kv_memory_bytes`` buys at the price the serving side
    pays per block: the pool's (:func:`kvcache.pools.budget_blocks`, what the plugin's runner
    allocates) with recycling, FastDeploy's one cache shape for every layer without.
    ``supported_requests``: the most requests of the shortest ``contexts`` entry held at once in
    those blocks (:func:`kvcache.pools.capacity`: recycling's count, or FastDeploy's accounting);
    ``max_num_seqs`` is that, within FastDeploy's ``[1, 512]`` and at most
    ``max_num_batched_tokens`` (``FDConfig.check``). ``notes``: why a number was capped.
    """

    recycle: str
    recycling: bool
    kv_memory_bytes: int
    num_gpu_blocks_override: int
    block_bytes: int
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    tensor_parallel_size: int
    context: int
    supported_requests: int
    max_num_seqs: int
    kv_cache_quant: str | None
    notes: tuple[str, ...] = ()

    @property
    def quantization(self) -> str | None:
        """``--quantization``'s JSON for a quantized cache (FastDeploy's ``mix_quant``)."""
        if self.kv_cache_quant is None:
            return None
        return json.dumps({"quantization": "mix_quant", "kv_cache_quant_type": self.kv_cache_quant})

    def argv(self) -> list[str]:
        """The FastDeploy server arguments, in order (``--quantization``'s JSON one item)."""
        out = [
            "--model-impl",
            "paddlefleet",
            "--tensor-parallel-size",
            str(self.tensor_parallel_size),
            "--block-size",
            str(self.block_size),
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-batched-tokens",
            str(self.max_num_batched_tokens),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--num-gpu-blocks-override",
            str(self.num_gpu_blocks_override),
        ]
        if self.quantization is not None:
            out += ["--quantization", self.quantization]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "env": {"FD_PLUGINS": "paddlefleet", RECYCLE_VAR: self.recycle},
            "model_impl": "paddlefleet",
            "tensor_parallel_size": self.tensor_parallel_size,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "num_gpu_blocks_override": self.num_gpu_blocks_override,
            "quantization": None if self.quantization is None else json.loads(self.quantization),
            "kv_memory_bytes": self.kv_memory_bytes,
            "block_bytes": self.block_bytes,
            "recycling": self.recycling,
            "context": self.context,
            "supported_requests": self.supported_requests,
            "notes": list(self.notes),
            "argv": self.argv(),
        }


def fastdeploy_flags(
    layout: PoolLayout,
    uniform_block_bytes: int,
    memory_bytes: int,
    dtype: str,
    contexts: tuple[int, ...],
    *,
    max_model_len: int,
    max_num_batched_tokens: int,
    tensor_parallel_size: int,
    recycle: str,
    kv_cache_quant: str | None = None,
) -> FastDeployFlags:
    """:class:`FastDeployFlags` for ``layout`` (the pool every rank agrees on) in ``memory_bytes`` of
    KV memory per rank; ``uniform_block_bytes``: FastDeploy's price of one block in its one cache
    shape (used when recycling is off or nothing slides). ``ValueError`` names a bad value."""
    if recycle not in ("auto", "off"):
        raise ValueError(f"recycle={recycle!r}: expected 'auto' or 'off'")
    if isinstance(uniform_block_bytes, bool) or not isinstance(uniform_block_bytes, int):
        raise TypeError(f"uniform_block_bytes={uniform_block_bytes!r}: expected an int")
    if uniform_block_bytes < 1:
        raise ValueError(f"uniform_block_bytes={uniform_block_bytes!r}: expected an int >= 1")
    if not contexts:
        raise ValueError("contexts=(): expected at least one request length")
    recycling = recycle == "auto" and layout.slides
    if recycling:
        price = layout.block_bytes(dtype, kv_cache_quant)
        blocks = budget_blocks(layout, memory_bytes, dtype, kv_cache_quant)
    else:
        price = uniform_block_bytes
        blocks = memory_bytes // price
    context = min(contexts)
    cap = capacity(layout, blocks, context, max_num_batched_tokens=max_num_batched_tokens)
    supported = cap.recycling_requests if recycling else cap.fastdeploy_requests
    seqs = max(1, min(supported, FASTDEPLOY_MAX_NUM_SEQS, max_num_batched_tokens))
    notes = []
    if supported > seqs:
        why = (
            f"FastDeploy's limit of {FASTDEPLOY_MAX_NUM_SEQS}"
            if seqs == FASTDEPLOY_MAX_NUM_SEQS
            else f"--max-num-batched-tokens {max_num_batched_tokens}"
        )
        notes.append(f"the memory holds {supported} requests of {context} tokens; capped at {why}")
    if supported == 0:
        notes.append(f"the memory holds no request of {context} tokens: FastDeploy will not serve one")
    if max_num_batched_tokens > max_model_len * seqs:
        notes.append(
            f"FastDeploy requires max_num_batched_tokens <= max_model_len * max_num_seqs "
            f"({max_model_len} * {seqs}): lower --max-num-batched-tokens"
        )
    if kv_cache_quant is not None:  # kernels/kv_dequant_gather.py: beside the cache, not inside it
        from ..envs import dequant_scratch_mb  # not at import: the CLI's --help prints whatever the switches

        notes.append(
            f"on sm_90 the Hopper prefill of a quantized cache also takes {dequant_scratch_mb()} MiB per "
            "head geometry (FDFLEET_DEQUANT_SCRATCH_MB) beside this KV memory for its dequantized copy of a "
            "step's pages"
        )
    return FastDeployFlags(
        recycle=recycle,
        recycling=recycling,
        kv_memory_bytes=memory_bytes,
        num_gpu_blocks_override=blocks,
        block_bytes=price,
        block_size=layout.block_size,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        tensor_parallel_size=tensor_parallel_size,
        context=context,
        supported_requests=supported,
        max_num_seqs=seqs,
        kv_cache_quant=kv_cache_quant,
        notes=tuple(notes),
    )


def format_flags(f: FastDeployFlags) -> str:
    """The "FastDeploy flags" section: the environment and the server arguments, one command."""
    quant = f" --quantization '{f.quantization}'" if f.quantization is not None else ""
    env = f"FD_PLUGINS=paddlefleet {RECYCLE_VAR}={f.recycle}"
    if f.recycling:
        how = "the pool's price, recycling on"
    elif f.recycle == "off":
        how = "FastDeploy's one cache shape, recycling off"
    else:
        how = "FastDeploy's one cache shape: nothing slides on every rank, nothing to recycle"
    lines = [
        "FastDeploy flags (per rank: the KV memory above pinned as a block count; FastDeploy then skips "
        "profiling, so --gpu-memory-utilization does not size the cache):",
        f"  {env} python -m fastdeploy.entrypoints.openai.api_server --model MODEL "
        + " ".join(f.argv()[:-2] if quant else f.argv())
        + quant,
        f"  --num-gpu-blocks-override {f.num_gpu_blocks_override}: {format_bytes(f.kv_memory_bytes)} // "
        f"{format_bytes(f.block_bytes)} per block ({how})",
        f"  --max-num-seqs {f.max_num_seqs}: requests of {f.context} tokens held at once "
        f"({f.supported_requests} fit)",
    ]
    lines += [f"  note: {n}" for n in f.notes]
    return "\n".join(lines)


def flags_for(
    source: Any,
    tp: int,
    tp_rank: int,
    block_size: int,
    dtype: str,
    memory_gib: float,
    contexts: tuple[int, ...],
    *,
    max_model_len: int | None,
    max_num_batched_tokens: int,
    recycle: str,
    kv_cache_quant: str | None = None,
) -> FastDeployFlags:
    """:func:`fastdeploy_flags` for ``source`` (``plan_from_config``'s input) over ``tp`` ranks: the
    pool every rank agrees on, FastDeploy's one cache shape of rank ``tp_rank``."""
    plans = [plan_from_config(source, tp_size=tp, tp_rank=r) for r in range(tp)]
    layout = layout_from_plans(merge_tp_plans(plans), block_size).pool
    uniform = uniform_cost(plans[tp_rank], dtype, kv_cache_quant).bytes_per_token_uniform * block_size
    return fastdeploy_flags(
        layout,
        uniform,
        int(memory_gib * GIB),
        dtype,
        contexts,
        max_model_len=max_model_len or max(contexts),
        max_num_batched_tokens=max_num_batched_tokens,
        tensor_parallel_size=tp,
        recycle=recycle,
        kv_cache_quant=kv_cache_quant,
    )


def fastdeploy_flags_for_preset(preset: str, settings: Any) -> FastDeployFlags:
    """:func:`flags_for` at TP 1 for ``settings`` (``cli.figures.Settings``: the docs' figures)."""
    return flags_for(
        preset,
        1,
        0,
        settings.block_size,
        settings.dtype,
        settings.memory_gib,
        settings.contexts,
        max_model_len=None,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        recycle=settings.recycle,
        kv_cache_quant=settings.kv_cache_quant,
    )


def checked_contexts(args: argparse.Namespace) -> tuple[int, ...]:
    """``--context`` checked against ``--max-model-len`` and ``--block-size`` (``report.check_contexts``):
    a :class:`CliError` naming the flags and values otherwise."""
    try:
        return check_contexts(args.context, args.max_model_len, args.block_size)[0]
    except ValueError as e:
        ctx = ",".join(str(c) for c in args.context)
        message = str(e)
        if " is longer than max_model_len" in message:
            raise CliError(
                f"--context {ctx} --max-model-len {args.max_model_len}: {message}; "
                "give a larger --max-model-len or shorter --context"
            ) from e
        if message.startswith("max_model_len="):
            raise CliError(f"--max-model-len {args.max_model_len}: {message}") from e
        raise CliError(f"--context {ctx}: {message}") from e


def run(args: argparse.Namespace) -> int:
    args.dtype = model_dtype(args.dtype)
    try:
        recycle, recycle_source = recycle_setting()
    except ValueError as e:
        raise CliError(str(e)) from e
    try:
        raw = load_config(args.source)
        plan = plan_from_config(args.source, tp_size=args.tp, tp_rank=args.tp_rank)
    except (ValueError, TypeError) as e:  # named by SOURCE, plus the field the message names
        raise about(None, args.source, e) from e
    try:
        budget = kv_budget(
            plan, args.block_size, args.dtype, args.memory_gib, budget_context(args), args.kv_cache_quant
        )
    except ValueError as e:
        raise about("--dtype" if "dtype" in str(e) else None, None, e) from e
    contexts = checked_contexts(args)
    pools = pools_for(
        args.source,
        args.tp,
        args.block_size,
        args.dtype,
        args.memory_gib,
        contexts,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_quant=args.kv_cache_quant,
    )
    warnings = serving_refusals(raw) + capacity_warnings(raw, plan, budget, args) + pools_warnings(pools)
    flags = flags_for(
        args.source,
        args.tp,
        args.tp_rank,
        args.block_size,
        args.dtype,
        args.memory_gib,
        contexts,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        recycle=recycle,
        kv_cache_quant=args.kv_cache_quant,
    )
    if args.json:
        out = plan_json(plan.source, plan, budget, warnings, pools)
        out["recycle"] = {"value": recycle, "source": recycle_source, "in_effect": flags.recycling}
        out["fastdeploy_flags"] = flags.to_dict()
        print(json.dumps(out))
        return 0
    head = f"{plan.source}: {len(plan)} layers, window convention {plan.convention}"
    if plan.tp_size > 1:
        head += f", tp rank {plan.tp_rank} of {plan.tp_size}"
    print(head)
    print(format_table(plan))
    print()
    print(format_budget(budget))
    print(format_uniform(uniform_budget(plan, budget), budget))
    print(format_pools(pools, recycle, recycle_source))
    print(format_flags(flags))
    for line in warnings:
        print(f"WARNING: {line}")
    return 0
