"""The Triton backend: this step's K/V into the paged cache, then paged attention (``kernels/``).

Same contract as the reference backend (``backends/base.py``). Paddle tensors cross to torch by
DLPack (zero-copy, so cache writes land in the caller's cache) and the output goes back to paddle;
torch tensors pass straight through. Runs on CUDA; on CPU only under ``TRITON_INTERPRET=1``
(tests).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..spec.layer import LayerAttention
from .base import AttentionBackend, BatchMeta

logger = logging.getLogger(__name__)

_DTYPES = ("float16", "bfloat16", "float32")


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _to_torch(x: Any, device: Any = None, int32: bool = False) -> Any:
    """Torch view of a paddle / torch tensor (DLPack, zero-copy); numpy or lists are copied."""
    import torch

    if x is None:
        return None
    if not _is_torch(x):
        if hasattr(x, "__dlpack__") and type(x).__module__.startswith("paddle"):
            x = torch.from_dlpack(x)
        else:
            x = torch.as_tensor(x)
    if device is not None and x.device != device:
        x = x.to(device)
    if int32 and x.dtype != torch.int32:
        x = x.to(torch.int32)
    return x


def _to_paddle(x: Any) -> Any:
    import paddle

    return paddle.utils.dlpack.from_dlpack(x)


class TritonBackend(AttentionBackend):
    """Paged attention through the Triton kernels of :mod:`fastdeploy_paddlefleet.kernels`.

    ``validate=True`` runs :func:`backends.checks.validate_inputs` on every call (shape checks; the
    small metadata arrays are copied to the host once per step, shared by every layer).
    """

    name = "triton"
    supports_unequal_v_dim = True

    def __init__(self, validate: bool = True) -> None:
        self.validate = validate

    def check_layer(self, layer: LayerAttention) -> None:
        if layer.num_kv_heads <= 0 or layer.num_q_heads % layer.num_kv_heads:
            raise ValueError(
                f"layer {layer.index}: num_q_heads={layer.num_q_heads} is not a multiple of "
                f"num_kv_heads={layer.num_kv_heads}"
            )
        if layer.window_left is not None and layer.window_left < 0:
            raise ValueError(f"layer {layer.index}: window_left must be >= 0, got {layer.window_left}")

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
        """Write K/V into ``kv_cache`` then attend: ``q [T, Hq, Dqk]`` -> ``[T, Hq * Dv]`` (q's dtype
        and framework)."""
        from ..kernels.cache_write import write_kv_cache
        from ..kernels.paged_attention import paged_attention

        if self.validate:
            self._validate(q, k, v, layer, meta, kv_cache, sinks)
        self.check_layer(layer)
        return_paddle = not _is_torch(q)
        tq = _to_torch(q)
        dev = tq.device
        tk, tv = _to_torch(k, dev), _to_torch(v, dev)
        kc, vc = _to_torch(kv_cache[0]), _to_torch(kv_cache[1])
        dtype = str(tq.dtype).rsplit(".", 1)[-1]
        if dtype not in _DTYPES:
            raise TypeError(f"the triton backend runs {_DTYPES}, got q.dtype={tq.dtype}")
        if kc.dtype != tq.dtype or vc.dtype != tq.dtype:
            raise TypeError(f"kv_cache dtype must match q ({tq.dtype}), got {kc.dtype} / {vc.dtype}")
        if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tests), got q on {dev}"
            )
        cu = _to_torch(meta.cu_seqlens_q, dev, int32=True)
        dec = _to_torch(meta.seq_lens_decoder, dev, int32=True)
        bid = _to_torch(meta.batch_id_per_token, dev, int32=True)
        table = meta.headwise_table(layer.index)
        headwise = table is not None
        table = _to_torch(table if headwise else meta.block_tables, dev, int32=True)

        write_kv_cache(tk, tv, kc, vc, bid, cu, dec, table, headwise=headwise)
        slides = layer.sliding_kv_heads is not None and layer.window_left is not None
        out = paged_attention(
            tq,
            kc,
            vc,
            cu,
            dec,
            table,
            scale=layer.softmax_scale,
            headwise=headwise,
            window_left=layer.window_left if slides else None,
            sliding_heads=layer.sliding_kv_heads if slides else None,
            sink_kind=layer.sink,
            sinks=_to_torch(sinks, dev) if layer.sink == "learnable" else None,
            max_q_len=meta.max_seq_len_this_time,
            max_context_len=meta.max_context_len,
        )
        out = out.view(out.shape[0], -1)
        return _to_paddle(out) if return_paddle else out

    @staticmethod
    def _validate(q, k, v, layer, meta, kv_cache, sinks) -> None:
        # also checks the host maxima the kernels size their launches from
        from .checks import validate_inputs

        validate_inputs(q, k, v, layer, meta, kv_cache, sinks)
