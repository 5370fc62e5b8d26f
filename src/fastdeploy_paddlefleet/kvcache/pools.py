"""How a KV byte budget splits between full and sliding pools: ONE pure function, both sides.

The engine's scheduler hook (``serving/kv_recycling``) sizes its page pools with
:func:`split_kv_pools`, the worker sizes its per-group caches with the same call, and
``fdfleet plan`` reports it; all three must agree, so nothing else computes a split.

Per group ``g`` (``kvcache/headwise.py``: layers sharing kv heads and windows) one block costs
``block_bytes_g = block_size * sum over g's layers of kv_heads * (qk_head_dim + v_head_dim) * dtype``.
A request at ``max_model_len`` tokens holds ``ceil((max_model_len + lookahead) / bs)`` blocks on
a full lane and on average ``(W + 1 + lookahead / 2) / bs + 1`` on a sliding one, where
``lookahead`` is what FastDeploy allocates beyond the computed tokens (2 blocks + 12 slots when
decoding; FastDeploy's own pool pays it too). Every group is
sized to run out at the same concurrency ``N``; when the expected concurrency (FastDeploy's
``max_num_seqs``) is below ``N``, sliding pools keep just enough for it and full pools get the
rest, where longer contexts can use it. Each sliding pool also keeps room for the largest single
allocation of its lanes (:func:`allocation_cap`), so a chunk can always be scheduled once the
others have released what left their windows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..plan.layer import AttentionPlan
from .headwise import RecycleMode, check_pool_pages, groups_from_plan
from .layout import blocks_for, dtype_bytes

#: tokens FastDeploy allocates beyond the computed ones for a decoding request: 2 blocks
#: (``enc_dec_block_num``) once 12 or fewer slots are left (``prealloc_dec_block_slot_num_threshold``)
FASTDEPLOY_LOOKAHEAD_BLOCKS = 2
FASTDEPLOY_LOOKAHEAD_SLOTS = 12


@dataclass(frozen=True)
class GroupPool:
    """One group's pool: ``num_blocks`` blocks of ``block_bytes`` each."""

    index: int
    kind: str
    layers: tuple[int, ...]
    num_kv_heads: int
    block_bytes: int
    blocks_per_request: float
    num_blocks: int

    @property
    def bytes(self) -> int:
        return self.block_bytes * self.num_blocks


@dataclass(frozen=True)
class PoolSplit:
    """The split of ``budget_bytes`` and what it holds at ``max_model_len`` tokens per request.

    ``max_requests``: requests of ``max_model_len`` tokens every pool holds at once with
    recycling; ``fastdeploy_*``: FastDeploy's one pool (every layer keeps every block, each layer
    sized by its own shape) in the same bytes.
    """

    budget_bytes: int
    block_size: int
    max_model_len: int
    concurrency: int | None
    groups: tuple[GroupPool, ...]
    max_requests: int
    fastdeploy_block_bytes: int
    fastdeploy_num_blocks: int
    fastdeploy_max_requests: int
    #: blocks one ``max_model_len`` request holds in FastDeploy's pool (its look-ahead included)
    request_blocks: int = 0

    @property
    def num_blocks(self) -> list[int]:
        """Blocks per group, in group order (``HeadwiseKVManager``'s ``num_blocks``)."""
        return [g.num_blocks for g in self.groups]

    @property
    def used_bytes(self) -> int:
        return sum(g.bytes for g in self.groups)

    @property
    def ratio(self) -> float:
        """Concurrent ``max_model_len`` requests against FastDeploy's accounting."""
        return self.max_requests / max(1, self.fastdeploy_max_requests)

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_bytes,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "concurrency": self.concurrency,
            "groups": [
                {
                    "index": g.index,
                    "kind": g.kind,
                    "layers": list(g.layers),
                    "num_kv_heads": g.num_kv_heads,
                    "block_bytes": g.block_bytes,
                    "blocks_per_request": g.blocks_per_request,
                    "num_blocks": g.num_blocks,
                    "bytes": g.bytes,
                }
                for g in self.groups
            ],
            "used_bytes": self.used_bytes,
            "max_requests": self.max_requests,
            "fastdeploy_block_bytes": self.fastdeploy_block_bytes,
            "fastdeploy_num_blocks": self.fastdeploy_num_blocks,
            "fastdeploy_max_requests": self.fastdeploy_max_requests,
            "request_blocks": self.request_blocks,
            "ratio": self.ratio,
        }


def allocation_cap(window_left: int, block_size: int, max_num_batched_tokens: int) -> int:
    """Most units one FastDeploy allocation can add to a sliding lane with ``window_left``.

    After ``reserve(target, computed)`` a sliding lane holds the blocks of
    ``[computed - window_left, target)``; FastDeploy's ``target - computed`` is at most one
    step's tokens plus a partial block (prefill) or 2 blocks + 12 slots + 1 (decode).
    """
    step = max(
        max_num_batched_tokens + block_size,
        FASTDEPLOY_LOOKAHEAD_BLOCKS * block_size + FASTDEPLOY_LOOKAHEAD_SLOTS + 1,
    )
    return -(-(window_left + step) // block_size) + 2


def _per_request(groups: list, bs: int, ctx: int, lookahead: int) -> list[float]:
    """Blocks one request holds per group on average over its decode: a full lane
    ``ceil((ctx + lookahead) / bs)`` (FastDeploy's own count), a sliding lane the window plus the
    query's block plus half the look-ahead (it runs from 12 slots to 2 blocks + 12 slots), in
    blocks: ``(W + 1 + lookahead / 2) / bs + 1``. Many requests at different points of their
    look-ahead sum to about this; the pools' headroom (:func:`allocation_cap`) and FastDeploy's
    preemption absorb the rest, and ``can_allocate`` never promises more than the pools hold."""
    full = -(-(ctx + lookahead) // bs)
    out = []
    for g in groups:
        share = g.unit / g.num_kv_heads
        out.append(
            sum((full if w is None else min(full, (w + 1 + lookahead / 2) / bs + 1)) * share for w in g.lanes)
        )
    return out


def _int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r}: expected an int >= {low}")
    return value


def split_kv_pools(
    plan: AttentionPlan,
    budget_bytes: int,
    block_size: int,
    max_model_len: int,
    concurrency: int | None = None,
    *,
    dtype: Any = "bf16",
    mode: RecycleMode = "headwise",
    max_num_batched_tokens: int = 0,
    lookahead_tokens: int | None = None,
) -> PoolSplit:
    """Split ``budget_bytes`` of KV memory (one rank) into blocks per layer group.

    ``plan``: the plan whose windows hold on every rank (``serving/kv_recycling/protocol.py``
    ``merge_tp_plans``). ``concurrency``: requests expected at once (``max_num_seqs``; None: no
    cap). ``max_num_batched_tokens``: one step's prefill tokens, held transiently in full by
    sliding lanes. ``lookahead_tokens``: tokens allocated beyond the computed ones (default:
    FastDeploy's 2 blocks + 12 slots). Refuses (``ValueError`` naming the numbers) a budget that
    cannot hold one ``max_model_len`` request.
    """
    if not isinstance(plan, AttentionPlan):
        raise TypeError(f"plan must be an AttentionPlan, got {type(plan).__name__}")
    budget = _int("budget_bytes", budget_bytes, 1)
    bs = _int("block_size", block_size, 1)
    ctx = _int("max_model_len", max_model_len, 1)
    cap = None if concurrency is None else _int("concurrency", concurrency, 1)
    batched = _int("max_num_batched_tokens", max_num_batched_tokens, 0)
    if lookahead_tokens is None:
        lookahead_tokens = FASTDEPLOY_LOOKAHEAD_BLOCKS * bs + FASTDEPLOY_LOOKAHEAD_SLOTS
    nbytes = dtype_bytes(dtype)
    groups = groups_from_plan(plan, mode)
    layer_bytes = {la.index: bs * la.num_kv_heads * (la.qk_head_dim + la.v_head_dim) * nbytes for la in plan}
    bb = [sum(layer_bytes[li] for li in g.layers) for g in groups]
    per_req = _per_request(groups, bs, ctx, lookahead_tokens)
    # room for the largest single allocation of each sliding lane, whatever the others hold
    trans = [
        sum(allocation_cap(w, bs, batched) * g.unit / g.num_kv_heads for w in g.lanes if w is not None)
        for g in groups
    ]

    per_req_bytes = sum(b * p for b, p in zip(bb, per_req, strict=True))
    fixed = sum(b * t for b, t in zip(bb, trans, strict=True))
    n_eq = (budget - fixed) / per_req_bytes
    if n_eq < 1:
        raise ValueError(
            f"KV budget of {budget} bytes cannot hold one request of max_model_len={ctx} tokens: "
            f"it needs {int(per_req_bytes)} bytes (block_size={bs}) plus {int(fixed)} bytes for "
            f"max_num_batched_tokens={batched}; lower max_model_len or give the KV cache more memory"
        )
    n = [n_eq] * len(groups)
    full = [all(w is None for w in g.lanes) for g in groups]
    if cap is not None and cap < n_eq and any(full) and not all(full):
        # sliding pools hold the expected concurrency; the full pools take the rest
        slide_bytes = sum(
            b * (cap * p + t) for b, p, t, f in zip(bb, per_req, trans, full, strict=True) if not f
        )
        full_bytes = sum(b * p for b, p, f in zip(bb, per_req, full, strict=True) if f)
        n_full = (budget - slide_bytes) / full_bytes
        n = [n_full if f else cap for f in full]
    blocks = [int(k * p + t) for k, p, t in zip(n, per_req, trans, strict=True)]
    check_pool_pages(groups, blocks, f"budget_bytes={budget}")
    max_requests = min(int((nb - t) // p) for nb, p, t in zip(blocks, per_req, trans, strict=True))
    fd_block = sum(layer_bytes.values())
    fd_blocks = budget // fd_block
    pools = tuple(
        GroupPool(g.index, g.kind, g.layers, g.num_kv_heads, b, p, nb)
        for g, b, p, nb in zip(groups, bb, per_req, blocks, strict=True)
    )
    return PoolSplit(
        budget_bytes=budget,
        block_size=bs,
        max_model_len=ctx,
        concurrency=cap,
        groups=pools,
        max_requests=max_requests,
        fastdeploy_block_bytes=fd_block,
        fastdeploy_num_blocks=fd_blocks,
        fastdeploy_max_requests=fd_blocks // blocks_for(ctx + lookahead_tokens, bs),
        request_blocks=blocks_for(ctx + lookahead_tokens, bs),
    )


def split_fastdeploy_blocks(
    plan: AttentionPlan,
    num_gpu_blocks: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int = 0,
    *,
    dtype: Any = "bf16",
    mode: RecycleMode = "headwise",
) -> PoolSplit:
    """:func:`split_kv_pools` of the bytes FastDeploy's ``num_gpu_blocks`` stand for.

    FastDeploy counts ``num_gpu_blocks`` (``cache_config.total_block_num``) blocks of every layer
    at once; with per-layer shapes one such block costs ``PoolSplit.fastdeploy_block_bytes``, so
    the budget is ``num_gpu_blocks * fastdeploy_block_bytes``. The engine's scheduler hook and the
    worker call this with the same FastDeploy settings and get the same blocks per group.
    """
    nbytes = dtype_bytes(dtype)
    bs = _int("block_size", block_size, 1)
    per_block = bs * sum(la.num_kv_heads * (la.qk_head_dim + la.v_head_dim) * nbytes for la in plan)
    blocks = _int("num_gpu_blocks", num_gpu_blocks, 1)
    return split_kv_pools(
        plan,
        blocks * per_block,
        bs,
        max_model_len,
        max_num_seqs,
        dtype=dtype,
        mode=mode,
        max_num_batched_tokens=max_num_batched_tokens,
    )


__all__ = [
    "FASTDEPLOY_LOOKAHEAD_BLOCKS",
    "allocation_cap",
    "FASTDEPLOY_LOOKAHEAD_SLOTS",
    "GroupPool",
    "PoolSplit",
    "split_fastdeploy_blocks",
    "split_kv_pools",
]
