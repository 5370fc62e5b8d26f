"""Quantized KV cache formats: FastDeploy's ``kv_cache_quant_type`` values, what each stores and costs
(stdlib only).

FastDeploy (develop c1b7c083d) allocates a quantized cache as ``uint8`` in the usual shape
``[num_blocks, kv_heads, block_size, head_dim]``, one byte per element
(``worker/gpu_model_runner.py``, ``initialize_kv_cache``). What a byte means:

* ``block_wise_fp8`` (dynamic, no calibration): an fp8 e4m3 code, quantized per token and kv head
  with the scale ``448 / max|x|`` of that token-head's vector; the cache also holds the dequant
  multipliers ``1 / (448 / max|x|)`` in ``key_scales`` / ``value_scales``
  ``[num_blocks, kv_heads, block_size]`` in the model dtype (FastDeploy passes them after the layer's
  K and V: ``[k, v, k_scales, v_scales]`` per layer).
* ``float8_e4m3fn`` (static, FastDeploy's ``cache_fp8``): an fp8 e4m3 code at the checkpoint's
  scale, one per kv head (``[kv_heads]``) or per channel (``[kv_heads * head_dim]``).
* ``int8`` (static, ``cache_int8``): ``code + 128`` of a signed code in [-127, 127], per channel.

Everywhere in this package a cache's *scale* is the **dequant multiplier**: ``x ~= code * scale``
(FastDeploy's ``cache_k_out_scale``); the quant multiplier ``1 / scale`` is FastDeploy's
``cache_k_scale``. The zero-point formats (``int8_zp``, ``int4_zp``, ``float8_e4m3fn_zp``) and
``float8_e4m3`` (bound 240) are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: FastDeploy's names for formats this package does not serve, and why
REFUSED: dict[str, str] = {
    "int8_zp": "a zero-point int8 cache",
    "int4_zp": "a zero-point int4 cache (two codes per byte)",
    "float8_e4m3fn_zp": "a zero-point fp8 cache",
    "float8_e4m3": "an fp8 cache with FastDeploy's 240 bound (a non-standard e4m3 variant)",
}

#: checkpoint / FastDeploy spellings of the same formats
ALIASES: dict[str, str] = {
    "cache_fp8": "float8_e4m3fn",
    "fp8": "float8_e4m3fn",
    "cache_int8": "int8",
    "block_wise_fp8": "block_wise_fp8",
}


@dataclass(frozen=True)
class KVCacheQuant:
    """One quantized cache format.

    * ``name``: FastDeploy's ``kv_cache_quant_type``
    * ``code``: ``"fp8"`` (e4m3fn bits) or ``"int8"`` (``uint8 = code + 128``)
    * ``dynamic``: scales computed per token and kv head at write time (else from the checkpoint)
    * ``max_bound``: the code range's bound (448 for fp8, 127 for int8); values saturate to it
    * ``channel_wise``: static scales per channel ``[kv_heads * head_dim]`` (else per kv head)
    """

    name: str
    code: str
    dynamic: bool
    max_bound: float
    channel_wise: bool = False

    def scale_shape(self, num_blocks: int, kv_heads: int, block_size: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one K (or V) scale tensor: ``[num_blocks, kv_heads, block_size]`` for dynamic
        formats (in the cache), ``[kv_heads * head_dim]`` or ``[kv_heads]`` for static ones (layer
        parameters, loaded from the checkpoint)."""
        if self.dynamic:
            return (num_blocks, kv_heads, block_size)
        return (kv_heads * head_dim,) if self.channel_wise else (kv_heads,)

    def token_bytes(self, kv_heads: int, head_dim: int, scale_bytes: int) -> int:
        """Cache bytes one token of one K (or V) cache takes: a byte per element, plus a dynamic
        format's per-token-head scale of ``scale_bytes`` (the model dtype's size)."""
        return kv_heads * head_dim + (kv_heads * scale_bytes if self.dynamic else 0)


FORMATS: dict[str, KVCacheQuant] = {
    "block_wise_fp8": KVCacheQuant("block_wise_fp8", "fp8", True, 448.0),
    "float8_e4m3fn": KVCacheQuant("float8_e4m3fn", "fp8", False, 448.0),
    "int8": KVCacheQuant("int8", "int8", False, 127.0, channel_wise=True),
}


def kv_cache_quant(value: Any, channel_wise: bool | None = None) -> KVCacheQuant | None:
    """The format FastDeploy's ``kv_cache_quant_type`` names: ``None`` for no quantization
    (``None``, ``""``, ``"none"``); ``ValueError`` naming the value for a refused or unknown format,
    ``TypeError`` for a non-string. ``channel_wise`` overrides the static fp8 scale layout
    (FastDeploy forces int8 to per channel)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"kv_cache_quant_type={value!r}: expected a string, got {type(value).__name__}")
    key = value.strip().lower()
    if key in ("", "none", "null"):
        return None
    if key in REFUSED:
        raise ValueError(
            f"kv_cache_quant_type={value!r}: {REFUSED[key]} is not served by the paddlefleet plugin; "
            f"use one of {', '.join(FORMATS)}"
        )
    fmt = FORMATS.get(ALIASES.get(key, key))
    if fmt is None:
        raise ValueError(f"kv_cache_quant_type={value!r}: unknown; expected one of {', '.join(FORMATS)}")
    if channel_wise is not None and fmt.name == "float8_e4m3fn":
        fmt = KVCacheQuant(fmt.name, fmt.code, fmt.dynamic, fmt.max_bound, channel_wise=bool(channel_wise))
    return fmt
