"""The pools report of ``fdfleet plan``: FastDeploy's one pool beside the recycling split (stdlib only).

The split is :func:`kvcache.pools.split_kv_pools` over the plan every TP rank agrees on
(``protocol.merge_tp_plans``), the same call the scheduler hook and the worker make.
"""

from __future__ import annotations

from typing import Any

from ...kvcache.layout import GIB, format_bytes
from ...kvcache.pools import PoolSplit, split_kv_pools
from .protocol import layout_from_plans, merge_tp_plans

#: FastDeploy's ``max_num_batched_tokens`` assumed by the report (one step's prefill tokens)
REPORT_BATCHED_TOKENS = 8192


def pools_for(
    source: Any, tp_size: int, block_size: int, dtype: str, memory_gib: float, context: int
) -> PoolSplit | str:
    """The split for ``memory_gib`` GiB per rank at ``context`` tokens, or why there is none."""
    from ...plan.config import plan_from_config

    plans = [plan_from_config(source, tp_size=tp_size, tp_rank=r) for r in range(tp_size)]
    plan = merge_tp_plans(plans)
    if not layout_from_plans(plan, block_size).slides:
        return "no lane slides on every rank: FastDeploy's one pool is the split (nothing to recycle)"
    try:
        return split_kv_pools(
            plan,
            int(memory_gib * GIB),
            block_size,
            context,
            dtype=dtype,
            max_num_batched_tokens=REPORT_BATCHED_TOKENS,
        )
    except ValueError as e:
        return str(e)


def format_pools(split: PoolSplit | str, uniform_num_blocks: int) -> str:
    """Text lines: FastDeploy today vs the full / sliding pools and their max concurrent requests
    (``uniform_num_blocks``: FastDeploy's blocks in its one cache shape, ``cache_views``)."""
    head = "Window recycling pools (FDFLEET_KV_RECYCLE=auto; same bytes, FastDeploy's 2-block look-ahead):"
    if isinstance(split, str):
        return f"{head}\n  {split}"
    rows = [
        (
            "FastDeploy today",
            f"one pool of {split.fastdeploy_num_blocks} blocks ({format_bytes(split.fastdeploy_block_bytes)} "
            f"each, every layer keeps every block): max {split.fastdeploy_max_requests} requests "
            f"({uniform_num_blocks // max(1, split.request_blocks)} in its one cache shape)",
        )
    ]
    for g in split.groups:
        rows.append(
            (
                f"{g.kind} pool (group {g.index})",
                f"{g.num_blocks} blocks x {format_bytes(g.block_bytes)} = {format_bytes(g.bytes)} "
                f"(layers: {len(g.layers)}, {g.blocks_per_request:.1f} blocks per request)",
            )
        )
    rows.append(
        (
            "max requests",
            f"{split.max_requests} of {split.max_model_len} tokens with recycling "
            f"(x{split.ratio:.2f} FastDeploy's accounting)",
        )
    )
    return "\n".join([head] + [f"  {label:<22} {value}" for label, value in rows])


__all__ = ["REPORT_BATCHED_TOKENS", "format_pools", "pools_for"]
