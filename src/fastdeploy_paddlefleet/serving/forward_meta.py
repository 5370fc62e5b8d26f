"""FastDeploy's ``ForwardMeta`` -> the plugin's ``BatchMeta``, cache pairs and packed positions.

FastDeploy fills one ``ForwardMeta`` per step (names: ``seq_lens_encoder``, ``seq_lens_decoder``,
``seq_lens_this_time``, ``cu_seqlens_q``, ``batch_id_per_token``, ``block_tables``, ``caches``,
``exist_prefill``); this module translates it without any host synchronisation, so the step it
feeds can be captured in a CUDA graph.

Checks at this edge cost O(1) per field and never read device values: integer dtypes only (a float
``block_tables`` would be truncated), int64 values range-checked where the host holds them (lists,
numpy, CPU tensors) and refused on a device (narrowing would wrap 2**32 to 0), every cache tensor
distinct. Checks on the values (aliasing, ranges) belong to the backend's checked mode
(``backends/checks.py``); in served mode the kernels bounds-check every table entry and record the
first bad one in a device error flag (``PaddleFleetForCausalLM`` reads it, ``docs/fastdeploy.md``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import paddle

from ..backends import BatchMeta
from ..backends.base import host_int
from ..backends.checks import check_int32_narrowing, check_int_dtype, is_on_host, to_numpy
from ..plan.layer import AttentionPlan
from ._fields import field as _get

#: per-request lengths: never negative (checked where the host holds them; device values are not read)
_LENGTHS = ("seq_lens_this_time", "seq_lens_decoder", "seq_lens_encoder")


def _int32(value: Any, name: str) -> paddle.Tensor:
    """``forward_meta.<name>`` as a paddle int32 tensor, refused rather than narrowed wrongly: a float
    or bool dtype (``TypeError``; the cast would truncate 2.7 to 2), values outside int32 where the host
    holds them (``ValueError``; 2**32 would wrap to 0), a wider dtype on a device (``TypeError``: its
    values cannot be checked without a sync). Sync-free: dtype, place and host values only."""
    if value is None:
        raise ValueError(f"forward_meta.{name} is required, got None")
    check_int_dtype(f"forward_meta.{name}", value)
    check_int32_narrowing(f"forward_meta.{name}", value)
    if name in _LENGTHS and is_on_host(value):  # a length below 0 would read no keys: zeros, no error
        a = np.asarray(to_numpy(value)).reshape(-1)
        if a.size and int(a.min()) < 0:
            b = int(np.argmax(a < 0))
            raise ValueError(
                f"forward_meta.{name}[{b}] = {int(a[b])}: sequence lengths must be >= 0 (got {a.tolist()})"
            )
    t = value if isinstance(value, paddle.Tensor) else paddle.to_tensor(np.asarray(value))
    return t if t.dtype == paddle.int32 else t.astype("int32")


def _int32_flat(value: Any, name: str) -> paddle.Tensor:
    return _int32(value, name).reshape([-1])


def _headwise_tables(value: Any) -> Any:
    """``forward_meta.block_tables_headwise`` (one table or ``layer index -> table``) with each table
    checked and narrowed like ``block_tables``; ``None`` passes."""
    name = "block_tables_headwise"
    if value is None:
        return None
    if isinstance(value, Mapping):
        return {layer: _int32(t, f"{name}[{layer!r}]") for layer, t in value.items()}
    return _int32(value, name)


def pair_caches(caches: Sequence[Any] | None, num_layers: int) -> list[tuple[Any, Any]]:
    """FastDeploy's flat ``[k0, v0, k1, v1, ...]`` (or already paired) -> ``[(k_l, v_l), ...]``."""
    if caches is None:
        raise ValueError("forward_meta.caches is required (the paged KV caches), got None")
    items = list(caches)
    if items and all(isinstance(c, tuple | list) and len(c) == 2 for c in items):
        pairs = [tuple(c) for c in items]
    else:
        if len(items) % 2:
            raise ValueError(f"forward_meta.caches must hold key/value pairs, got {len(items)} tensors")
        pairs = [(items[i], items[i + 1]) for i in range(0, len(items), 2)]
    if len(pairs) < num_layers:
        raise ValueError(
            f"forward_meta.caches holds {len(pairs)} key/value pairs, the plan has {num_layers} layers"
        )
    _check_distinct_tensors(pairs)
    return pairs


def _check_distinct_tensors(pairs: list[tuple[Any, Any]]) -> None:
    """Every cache tensor of the step appears once (O(layers), identity only): one tensor as both K and
    V, or shared by two layers, would have one write overwrite the other's keys."""
    seen: dict[int, str] = {}
    for layer, pair in enumerate(pairs):
        for kind, t in zip(("key", "value"), pair, strict=True):
            where = f"layer {layer} {kind}"
            first = seen.setdefault(id(t), where)
            if first != where:
                raise ValueError(
                    f"forward_meta.caches: the {where} cache is the same tensor as the {first} cache; "
                    "every layer's K and V caches must be distinct tensors"
                )


def layer_caches(
    caches: Sequence[Any] | None,
    plan: AttentionPlan,
    quant: Any = None,
    static_scales: Mapping[int, tuple[Any, Any]] | None = None,
) -> list[Any]:
    """FastDeploy's flat ``forward_meta.caches`` -> each layer's ``(key, value)`` views, or with
    ``quant`` (the model's ``kv_cache_quant_type``, a ``KVCacheQuant``) each layer's
    ``QuantizedKVCache`` of views (``[k, v, k_scales, v_scales]`` per layer for ``block_wise_fp8``,
    ``[k, v]`` uint8 plus ``static_scales[layer]`` for a static format).

    FastDeploy allocates one shape for every layer; each layer reads its leading kv heads and
    channels through strided views (``serving/cache_views.py``). Layouts other than the model's
    (``FD_ATTENTION_BACKEND=MLA_ATTN``, a quantized cache for an unquantized model) are refused
    naming the setting.
    """
    from .cache_views import check_cache_list, layer_cache_views, quantized_layer_cache_views

    if quant is not None:
        if caches is None:
            raise ValueError("forward_meta.caches is required (the paged KV caches), got None")
        return quantized_layer_cache_views(caches, plan, quant, static_scales)
    if caches is not None:
        check_cache_list(caches, len(plan))
    return layer_cache_views(pair_caches(caches, len(plan)), plan)


def batch_meta_from_forward_meta(
    forward_meta: Any,
    block_size: int | None = None,
    num_tokens: int | None = None,
    decode_tokens: int = 1,
) -> BatchMeta:
    """FastDeploy's ``ForwardMeta`` (or any object / mapping with its names) -> ``BatchMeta``.

    ``seq_lens_*`` may be ``[bsz]`` or ``[bsz, 1]``; ``batch_id_per_token`` is
    cut to ``num_tokens`` when given (FastDeploy may pad it). ``block_size``
    defaults to ``forward_meta.block_size``, else the key caches' dim 2.

    Nothing is copied to the host (a CUDA graph captures this step and replays it with other
    metadata): the launch bounds come from host-side facts only. ``max_seq_len_this_time`` is
    ``decode_tokens`` (1, or 1 + speculative tokens) when FastDeploy's host flag
    ``forward_meta.exist_prefill`` is ``False``, else unknown (``None``: the kernels bound their
    grids by the token count); ``max_context_len`` is left unknown (the kernels bound it by the
    block table's width and split each request's own key range at run time).
    """
    this = _int32_flat(_get(forward_meta, "seq_lens_this_time"), "seq_lens_this_time")
    bsz = int(this.shape[0])
    decoder = _int32_flat(_get(forward_meta, "seq_lens_decoder"), "seq_lens_decoder")
    encoder = _get(forward_meta, "seq_lens_encoder")
    encoder = paddle.zeros([bsz], "int32") if encoder is None else _int32_flat(encoder, "seq_lens_encoder")
    cu = _int32_flat(_get(forward_meta, "cu_seqlens_q"), "cu_seqlens_q")
    batch_id = _int32_flat(_get(forward_meta, "batch_id_per_token"), "batch_id_per_token")
    for name, t, want in (("seq_lens_decoder", decoder, bsz), ("seq_lens_encoder", encoder, bsz)):
        if int(t.shape[0]) != want:
            raise ValueError(
                f"forward_meta.{name} has {int(t.shape[0])} entries, seq_lens_this_time has {bsz}"
            )
    if int(cu.shape[0]) != bsz + 1:
        raise ValueError(
            f"forward_meta.cu_seqlens_q must have bsz + 1 = {bsz + 1} entries, got {int(cu.shape[0])}"
        )
    if num_tokens is not None:
        if int(batch_id.shape[0]) < num_tokens:
            raise ValueError(
                f"forward_meta.batch_id_per_token has {int(batch_id.shape[0])} entries "
                f"for {num_tokens} tokens"
            )
        batch_id = batch_id[:num_tokens]
    tables = _get(forward_meta, "block_tables")
    if tables is None:
        raise ValueError("forward_meta.block_tables is required, got None")
    tables = _int32(tables, "block_tables")
    where = "block_size (argument)"
    if block_size is None:
        block_size, where = _get(forward_meta, "block_size"), "forward_meta.block_size"
    if block_size is None:
        caches = _get(forward_meta, "caches")
        if caches:
            first = caches[0][0] if isinstance(caches[0], tuple | list) else caches[0]
            block_size, where = int(first.shape[2]), "block_size (the key caches' dim 2)"
    if block_size is None:
        raise ValueError("block_size must be a positive int (argument, forward_meta or caches), got None")
    block_size = host_int(where, block_size, 1)  # 4.7 or True refused, never truncated
    exist_prefill = _get(forward_meta, "exist_prefill")
    max_q = int(decode_tokens) if exist_prefill is False else None
    return BatchMeta(
        seq_lens_encoder=encoder,
        seq_lens_decoder=decoder,
        seq_lens_this_time=this,
        cu_seqlens_q=cu,
        batch_id_per_token=batch_id,
        block_tables=tables,
        block_size=int(block_size),
        block_tables_headwise=_headwise_tables(_get(forward_meta, "block_tables_headwise")),
        max_seq_len_this_time=max_q,
        max_context_len=None,
    )


def packed_positions(meta: BatchMeta, num_tokens: int) -> paddle.Tensor:
    """Absolute position of each packed token ``[T]`` int64.

    Token ``t`` of request ``b`` sits at ``seq_lens_decoder[b] + (t - cu_seqlens_q[b])``. Request ids
    are clipped into ``[0, bsz)`` on the device: padding tokens of a CUDA graph's padded batch may
    carry any id, and their rows are never used.
    """
    bsz = int(meta.seq_lens_decoder.shape[0])
    bid = meta.batch_id_per_token[:num_tokens].astype("int64").clip(0, max(bsz - 1, 0))
    cached = paddle.gather(meta.seq_lens_decoder.astype("int64"), bid)
    start = paddle.gather(meta.cu_seqlens_q[:-1].astype("int64"), bid)
    return cached + paddle.arange(num_tokens, dtype="int64") - start
