"""The attention backend interface and the per-step batch metadata.

One call per layer and step::

    out = backend.forward(q, k, v, layer, meta, kv_cache, sinks=None)

Shapes (``T`` = tokens packed over the batch this step):

* ``q``  ``[T, Hq, Dqk]``, ``k`` ``[T, Hkv, Dqk]``, ``v`` ``[T, Hkv, Dv]``
* ``kv_cache`` = ``(key_cache, value_cache)`` in FastDeploy's layout:
  ``key_cache [num_blocks, Hkv, block_size, Dqk]``,
  ``value_cache [num_blocks, Hkv, block_size, Dv]``
  or a :class:`QuantizedKVCache` (``uint8`` codes plus dequant scales; ``kvcache/quant.py``)
* ``sinks`` ``[Hq]`` float (this rank's slice) for ``learnable`` layers;
  ``off-by-one`` layers use a zero sink and need none; ``vanilla`` none.
* returns ``out [T, Hq * Dv]``.

The backend first writes this step's K/V into the cache slots of the tokens'
positions, then attends over the cache (so a token sees itself and every
earlier token of its request that is visible under the layer's window).

Head-wise block tables (``meta.block_tables_headwise``) index *pages*, not
blocks: page ``p`` is slice ``p`` of the cache viewed as
``[num_blocks * Hkv, block_size, D]``, i.e. page ``block * Hkv + head``.
Any free page can serve any request's any kv head, so pages a sliding head
releases become capacity for everyone. Row ``b * Hkv + h`` of the table is
request ``b``'s kv head ``h``; ``-1`` marks a page that is not there (released
or never allocated) and must never be read.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..kvcache.quant import KVCacheQuant
from ..plan.layer import LayerAttention

#: int32 on the device: sizes, lengths and maxima the kernels read
_INT32_MAX = 2**31 - 1


def host_int(name: str, value: Any, low: int = 0, high: int = _INT32_MAX) -> int:
    """``value`` as a host ``int`` in ``[low, high]``: ``TypeError`` for anything that is not an
    integer (``bool``, ``4.7``, ``4.0``, NaN, a string: a cast would truncate or read ``True`` as 1),
    ``ValueError`` out of range; both name ``name`` and the value. numpy integers pass."""
    if type(value) is int:
        v = value
    elif isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name}={value!r}: expected an int, got {type(value).__name__}")
    else:
        try:
            v = value.__index__()
        except TypeError:  # a tensor of more than one element, a float tensor
            raise TypeError(f"{name}={value!r}: expected an int, got {type(value).__name__}") from None
    if not low <= v <= high:
        raise ValueError(f"{name}={value!r}: expected an int in [{low}, {high}]")
    return v


@dataclass
class BatchMeta:
    """FastDeploy's ForwardMeta fields that attention reads (names kept).

    All per-request arrays have length ``bsz``; tensors may be paddle or torch
    (backends convert at their boundary) and are int32.

    * ``seq_lens_encoder [bsz]``: prefill tokens this step (0 for decode)
    * ``seq_lens_decoder [bsz]``: tokens already in the cache before this step
    * ``seq_lens_this_time [bsz]``: tokens this step (prefill chunk or 1)
    * ``cu_seqlens_q [bsz + 1]``: prefix sums of ``seq_lens_this_time``
    * ``batch_id_per_token [T]``: request index of each packed token
    * ``block_tables [bsz, max_blocks]``: logical block -> physical block, -1 absent
    * ``block_tables_headwise``: ``[bsz * Hkv, max_pages]`` page tables (see
      module doc), or a mapping ``layer index -> table`` when layers differ,
      or ``None`` (head-wise layers then derive pages from ``block_tables``)
    * ``block_size``: tokens per block
    * ``max_seq_len_this_time`` / ``max_context_len``: host-side maxima (ints)
      kernels use to size their grids without a device sync.

    The host scalars are checked at construction (O(1), no sync): ``block_size`` an int >= 1, the
    maxima ``None`` or ints >= 0 (NaN, inf, 7.5, ``True`` refused: a kernel grid sized from a
    truncated or wrapped bound drops rows), at least 1 when the step has tokens, and
    ``max_context_len >= max_seq_len_this_time`` (a request's keys include this step's queries).
    """

    seq_lens_encoder: Any
    seq_lens_decoder: Any
    seq_lens_this_time: Any
    cu_seqlens_q: Any
    batch_id_per_token: Any
    block_tables: Any
    block_size: int
    block_tables_headwise: Any = None
    max_seq_len_this_time: int | None = None
    max_context_len: int | None = None

    def __post_init__(self) -> None:
        bs = host_int("meta.block_size", self.block_size, 1)
        maxima = {}
        for name in ("max_seq_len_this_time", "max_context_len"):
            value = getattr(self, name)
            maxima[name] = None if value is None else host_int(f"meta.{name}", value, 0)
        tokens = getattr(self.batch_id_per_token, "shape", None)
        if tokens is not None and len(tokens) == 1 and int(tokens[0]) > 0:  # shape only: no sync
            for name, value in maxima.items():
                if value == 0:
                    raise ValueError(
                        f"meta.{name}=0 for a step of {int(tokens[0])} tokens: expected an int >= 1 "
                        "(or None: unknown)"
                    )
        mq, mc = maxima["max_seq_len_this_time"], maxima["max_context_len"]
        if mq is not None and mc is not None and mc < mq:
            raise ValueError(
                f"meta.max_context_len={mc} is below meta.max_seq_len_this_time={mq}: a request's keys "
                "include this step's queries"
            )
        self.block_size = bs
        self.max_seq_len_this_time, self.max_context_len = mq, mc

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens_this_time.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.batch_id_per_token.shape[0])

    def headwise_table(self, layer_index: int) -> Any:
        """The page table for ``layer_index`` (``None`` when there is none)."""
        t = self.block_tables_headwise
        if isinstance(t, Mapping):
            return t.get(layer_index)
        return t


class QuantizedKVCache(NamedTuple):
    """A quantized layer cache (``kv_cache`` argument of :meth:`AttentionBackend.forward`).

    * ``key`` ``uint8 [num_blocks, Hkv, block_size, Dqk]``, ``value`` ``uint8 [num_blocks, Hkv,
      block_size, Dv]``: one code per element, token-major inside a block like the unquantized cache
      (not FastDeploy's own C8 kernels' in-block swizzle: only this plugin's kernels read it).
    * ``key_scale`` / ``value_scale``: **dequant multipliers** (``x ~= code * scale``):
      ``[num_blocks, Hkv, block_size]`` in the model dtype for a dynamic format (``block_wise_fp8``:
      written with the codes), ``[Hkv]`` or ``[Hkv * D]`` float for a static one (from the
      checkpoint, read only).
    * ``quant``: the format (:class:`~fastdeploy_paddlefleet.kvcache.quant.KVCacheQuant`).
    * ``key_quant_scale`` / ``value_quant_scale`` (static formats only, optional): the **quant
      multipliers** the write multiplies by, FastDeploy's ``cache_k_scale`` / ``cache_v_scale``
      (``max_bound / s`` of the checkpoint's scale, rounded to the model dtype on their own:
      ``serving/kv_scales.py``), shaped and typed like the dequant multipliers, in the model dtype.
      ``None``: the write takes ``T(1 / scale)`` of the dequant multiplier, which can differ from
      FastDeploy's by one ulp of ``T`` (``docs/kv_quant.md``).

    Five fields at least, so ``k, v = kv_cache`` fails loudly on code that does not know quantized
    caches.
    """

    key: Any
    value: Any
    key_scale: Any
    value_scale: Any
    quant: KVCacheQuant
    key_quant_scale: Any = None
    value_quant_scale: Any = None


class AttentionBackend(abc.ABC):
    """Runs one layer's attention on the paged KV cache."""

    #: short name used by ``FDFLEET_BACKEND`` and the CLI
    name: str = "base"
    #: whether ``v_head_dim != qk_head_dim`` runs natively (else the adapter pads V)
    supports_unequal_v_dim: bool = True

    def check_layer(self, layer: LayerAttention) -> None:  # noqa: B027 - optional hook
        """Raise ``ValueError`` at patch time if this backend cannot run ``layer``."""

    @abc.abstractmethod
    def forward(
        self,
        q: Any,
        k: Any,
        v: Any,
        layer: LayerAttention,
        meta: BatchMeta,
        kv_cache: tuple[Any, Any],
        sinks: Any = None,
    ) -> Any:
        """Write this step's K/V into ``kv_cache`` and attend; see module doc for shapes."""
