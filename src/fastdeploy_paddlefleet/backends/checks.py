"""Input validation shared by every attention backend.

:func:`validate_inputs` checks one ``forward`` call (see ``backends/base.py``
for the contract) and raises ``ValueError`` / ``TypeError`` naming the bad
argument and its value. It works with paddle, torch or numpy tensors: shapes
and dtypes are read through ``.shape`` / ``.dtype``, and the small int
metadata is copied to the host once per step: the copies are memoized on the
``BatchMeta`` object, which every layer of a step shares, so a model with N
layers pays one device-to-host copy per step, not N. The host copy is
returned as a :class:`HostMeta` so a backend that needs the ints on the host
does not copy them again.

Cost: shape checks plus (once per step) one host copy of ``[bsz]``-sized
arrays and the block tables; no pass over q/k/v or the cache contents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..plan.layer import LayerAttention
from .base import BatchMeta

#: dtypes q/k/v and the cache may have (the part of ``str(dtype)`` after the last dot)
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def to_numpy(x: Any) -> Any:
    """Host numpy copy of a paddle / torch / numpy tensor or a (nested) list."""
    import numpy as np

    if isinstance(x, np.ndarray):
        return x
    mod = type(x).__module__
    if mod.startswith("torch"):
        return x.detach().cpu().numpy()
    if hasattr(x, "numpy"):  # paddle (copies device tensors to the host)
        return x.numpy()
    return np.asarray(x)


def _host(meta: BatchMeta, name: str, x: Any) -> Any:
    """``to_numpy(x)`` as int64, memoized on ``meta`` per field and tensor object (layers share it).

    ``TypeError`` for metadata that is not integer (a float table would be truncated: 2.7 -> 2)."""
    cache = meta.__dict__.setdefault("_host_arrays", {})
    hit = cache.get(name)
    if hit is None or hit[0] is not x:  # keyed on the object: a replaced field is copied again
        a = to_numpy(x)
        if a.dtype.kind not in "iu":
            field = name.split("@")[0].replace("page_table", "block_tables_headwise")
            raise TypeError(f"meta.{field} must hold integers (int32), got dtype {a.dtype}")
        hit = cache[name] = (x, a.astype("int64", copy=False))
    return hit[1]


def dtype_name(dtype: Any) -> str:
    """``paddle.float32`` / ``torch.float32`` / ``float32`` -> ``float32``."""
    return str(dtype).rsplit(".", 1)[-1]


@dataclass
class HostMeta:
    """Host (numpy int64) copy of the metadata one ``forward`` reads.

    * ``seq_lens_decoder``, ``seq_lens_this_time``: ``[bsz]``
    * ``cu_seqlens_q``: ``[bsz + 1]``
    * ``block_tables``: ``[bsz, max_blocks]``
    * ``page_table``: ``[bsz * Hkv, max_pages]`` head-wise page table of this
      layer, or ``None``
    """

    seq_lens_decoder: Any
    seq_lens_this_time: Any
    cu_seqlens_q: Any
    block_tables: Any
    page_table: Any
    num_tokens: int

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens_this_time.shape[0])


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in x.shape)


def _check_tensor(name: str, x: Any, expected: tuple[int | None, ...]) -> tuple[int, ...]:
    """Check rank, sizes (``None`` = any) and float dtype of ``x``; return its shape."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if type(x).__module__.split(".")[0] == "numpy":  # backends write and compute on the device
        raise TypeError(f"{name} must be a paddle or torch tensor, got numpy.{type(x).__name__}")
    shape = _shape(x)
    if len(shape) != len(expected):
        raise ValueError(
            f"{name} must have rank {len(expected)} {list(expected)}, got {name}.shape={list(shape)}"
        )
    for axis, (got, want) in enumerate(zip(shape, expected, strict=True)):
        if want is not None and got != want:
            raise ValueError(
                f"{name}.shape[{axis}] must be {want} (expected {list(expected)}), "
                f"got {name}.shape={list(shape)}"
            )
    if dtype_name(x.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have a float dtype {FLOAT_DTYPES}, got {name}.dtype={x.dtype}")
    return shape


def _check_layer(layer: LayerAttention) -> None:
    if not isinstance(layer, LayerAttention):
        raise TypeError(f"layer must be a LayerAttention, got {type(layer).__name__}")
    hq, hkv = layer.num_q_heads, layer.num_kv_heads
    if hkv <= 0 or hq <= 0 or hq % hkv != 0:
        raise ValueError(
            f"layer {layer.index}: num_q_heads={hq} must be a positive multiple of num_kv_heads={hkv}"
        )


def _int_array(meta: BatchMeta, name: str, length: int | None) -> Any:
    x = getattr(meta, name)
    if x is None:
        raise ValueError(f"meta.{name} is required, got None")
    a = _host(meta, name, x)
    if a.ndim != 1:
        raise ValueError(f"meta.{name} must be 1-D, got shape {list(a.shape)}")
    if length is not None and a.shape[0] != length:
        raise ValueError(f"meta.{name} must have length {length}, got {a.shape[0]}: {a.tolist()}")
    return a


def _read_ranges(layer: LayerAttention, dec: Any, end: Any, block_size: int) -> tuple[Any, Any]:
    """First and last logical block each kv head reads or writes: ``[bsz, Hkv]`` each.

    A head reads from the oldest position its first query sees
    (``dec - window_left``, or 0 for a full head) up to the newest token ``end - 1``.
    """
    import numpy as np

    windows = [layer.head_window(h) for h in range(layer.num_kv_heads)]
    lo = np.stack([np.zeros_like(dec) if w is None else np.maximum(dec - w, 0) for w in windows], axis=1)
    hi = np.repeat(((end - 1) // block_size)[:, None], len(windows), axis=1)
    return lo // block_size, hi


def _check_table(name: str, table: Any, lo: Any, hi: Any, active: Any, limit: int, unit: str) -> None:
    """Every entry of ``table[r, lo[r]..hi[r]]`` for active rows must be in ``[0, limit)``."""
    import numpy as np

    need = hi + 1
    short = active & (need > table.shape[1])
    if short.any():
        r = int(np.argmax(short))
        raise ValueError(
            f"{name} is too short: row {r} needs {int(need[r])} columns, "
            f"the table has {table.shape[1]} (shape {list(table.shape)})"
        )
    cols = np.arange(table.shape[1])[None, :]
    used = active[:, None] & (cols >= lo[:, None]) & (cols <= hi[:, None])
    bad = used & ((table < 0) | (table >= limit))
    if bad.any():
        r, c = (int(i) for i in np.argwhere(bad)[0])
        value = int(table[r, c])
        what = f"a -1 ({unit} not there)" if value == -1 else f"out of range [0, {limit})"
        raise ValueError(
            f"{name}[{r}, {c}] = {value} is {what}, but that {unit} is read or written this step"
        )


def _check_writes(name: str, table: Any, rows: Any, pos: Any, bs: int, unit: str) -> None:
    """No two (token, head) writes of one step may land on one cache slot: ``table[rows, pos // bs]``
    is the block/page each write uses, ``rows`` ``[T, H]`` (``H`` heads sharing a row, or 1)."""
    import numpy as np

    ids = table[rows, (pos // bs)[:, None]]  # [T, H]
    slots = (ids * bs + (pos % bs)[:, None]).reshape(-1)
    order = np.argsort(slots, kind="stable")
    dup = np.nonzero(np.diff(slots[order]) == 0)[0]
    if dup.size:
        a, b = (divmod(int(order[i]), rows.shape[1]) for i in (dup[0], dup[0] + 1))
        slot = int(slots[order[dup[0]]])
        raise ValueError(
            f"{name}: write collision: packed token {a[0]} (row {int(rows[a])}) and token {b[0]} "
            f"(row {int(rows[b])}) both write {unit} {slot // bs} slot {slot % bs} this step"
        )


def _check_page_heads(name: str, table: Any, used: Any, hkv: int) -> None:
    """A page holds one kv head's keys: the pages a step reads or writes may repeat only across
    requests for the same kv head (shared prefixes), never across heads or inside one row."""
    import numpy as np

    r, c = np.nonzero(used)
    if r.size < 2:
        return
    pages, heads = table[r, c], r % hkv
    order = np.lexsort((r, pages))
    p, h, rr = pages[order], heads[order], r[order]
    clash = (p[1:] == p[:-1]) & ((h[1:] != h[:-1]) | (rr[1:] == rr[:-1]))
    if clash.any():
        i = int(np.argmax(clash))
        if rr[i] == rr[i + 1]:
            raise ValueError(
                f"{name}: page {int(p[i])} appears twice in row {int(rr[i])} (kv head {int(h[i])}): "
                "two logical blocks on one page"
            )
        raise ValueError(
            f"{name}: page {int(p[i])} is mapped to row {int(rr[i])} (kv head {int(h[i])}) and row "
            f"{int(rr[i + 1])} (kv head {int(h[i + 1])}); a page holds one head's keys"
        )


def _check_operands(q: Any, k: Any, v: Any, layer: LayerAttention, meta: BatchMeta, kv_cache: Any) -> tuple:
    """Shapes and dtypes of one layer's operands (no host copy); returns ``(T, num_blocks, block_size)``."""
    _check_layer(layer)
    hq, hkv, dqk, dv = layer.num_q_heads, layer.num_kv_heads, layer.qk_head_dim, layer.v_head_dim
    t = _check_tensor("q", q, (None, hq, dqk))[0]
    _check_tensor("k", k, (t, hkv, dqk))
    _check_tensor("v", v, (t, hkv, dv))
    if not (dtype_name(q.dtype) == dtype_name(k.dtype) == dtype_name(v.dtype)):
        raise TypeError(f"q, k, v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not isinstance(meta, BatchMeta):
        raise TypeError(f"meta must be a BatchMeta, got {type(meta).__name__}")
    bs = meta.block_size
    if isinstance(bs, bool) or not isinstance(bs, int) or bs <= 0:
        raise ValueError(f"meta.block_size must be a positive int, got {bs!r}")
    if not isinstance(kv_cache, (tuple, list)) or len(kv_cache) != 2:
        raise TypeError(f"kv_cache must be a (key_cache, value_cache) pair, got {type(kv_cache).__name__}")
    nb = _check_tensor("kv_cache[0] (key cache)", kv_cache[0], (None, hkv, bs, dqk))[0]
    _check_tensor("kv_cache[1] (value cache)", kv_cache[1], (nb, hkv, bs, dv))
    if dtype_name(kv_cache[0].dtype) != dtype_name(kv_cache[1].dtype):
        raise TypeError(
            f"key and value caches must share one dtype, got {kv_cache[0].dtype} and {kv_cache[1].dtype}"
        )
    return t, nb, bs


def validate_inputs(
    q: Any,
    k: Any,
    v: Any,
    layer: LayerAttention,
    meta: BatchMeta,
    kv_cache: Any,
    sinks: Any = None,
) -> HostMeta:
    """Check one backend ``forward`` call; return the host copy of its metadata.

    Shapes: q ``[T, Hq, Dqk]``, k ``[T, Hkv, Dqk]``, v ``[T, Hkv, Dv]``,
    ``kv_cache = (key [num_blocks, Hkv, block_size, Dqk], value [num_blocks, Hkv, block_size, Dv])``,
    ``sinks [Hq]`` for ``learnable`` layers (ignored otherwise).
    Raises ``ValueError`` / ``TypeError`` naming the argument and its value.
    """
    import numpy as np

    t, nb, bs = _check_operands(q, k, v, layer, meta, kv_cache)
    hq, hkv = layer.num_q_heads, layer.num_kv_heads

    this_time = _int_array(meta, "seq_lens_this_time", None)
    bsz = this_time.shape[0]
    dec = _int_array(meta, "seq_lens_decoder", bsz)
    _int_array(meta, "seq_lens_encoder", bsz)
    cu = _int_array(meta, "cu_seqlens_q", bsz + 1)
    for name, a in (("seq_lens_this_time", this_time), ("seq_lens_decoder", dec)):
        if (a < 0).any():
            raise ValueError(f"meta.{name} must be >= 0, got {a.tolist()}")
    if cu[0] != 0 or (np.diff(cu) < 0).any() or cu[-1] != t:
        raise ValueError(
            f"meta.cu_seqlens_q must start at 0, not decrease and end at the token count T={t}, "
            f"got {cu.tolist()}"
        )
    if not np.array_equal(np.diff(cu), this_time):
        raise ValueError(
            f"meta.cu_seqlens_q={cu.tolist()} does not match meta.seq_lens_this_time={this_time.tolist()}"
        )
    bid = _int_array(meta, "batch_id_per_token", t)
    if not np.array_equal(bid, np.repeat(np.arange(bsz), this_time)):
        raise ValueError(
            f"meta.batch_id_per_token={bid.tolist()} does not match meta.cu_seqlens_q={cu.tolist()}"
        )

    end = dec + this_time
    active = this_time > 0
    # kernels size their launches from these host maxima: an understatement would drop rows
    for name, need in (
        ("max_seq_len_this_time", int(this_time.max(initial=0))),
        ("max_context_len", int(end[active].max(initial=0))),
    ):
        got = getattr(meta, name)
        if got is not None and got < need:
            raise ValueError(f"meta.{name}={got} is below this step's maximum {need}")

    if layer.sink == "learnable":
        if sinks is None:
            raise ValueError(
                f"layer {layer.index} has learnable sinks but sinks=None (expected shape [{hq}])"
            )
        if not hasattr(sinks, "shape") or _shape(sinks) != (hq,):
            got = list(_shape(sinks)) if hasattr(sinks, "shape") else type(sinks).__name__
            raise ValueError(f"sinks must have shape [{hq}] for layer {layer.index}, got {got}")

    if meta.block_tables is None:
        raise ValueError("meta.block_tables is required, got None")
    tables = _host(meta, "block_tables", meta.block_tables)
    if tables.ndim != 2 or tables.shape[0] != bsz:
        raise ValueError(
            f"meta.block_tables must have shape [bsz={bsz}, max_blocks], got {list(tables.shape)}"
        )

    lo, hi = _read_ranges(layer, dec, end, bs)  # [bsz, Hkv]
    page_table = meta.headwise_table(layer.index)
    if page_table is not None:
        page_table = _host(meta, f"page_table@{id(page_table)}", page_table)
        if page_table.ndim != 2 or page_table.shape[0] != bsz * hkv:
            raise ValueError(
                f"head-wise table of layer {layer.index} must have shape "
                f"[bsz * Hkv = {bsz * hkv}, max_pages], "
                f"got {list(page_table.shape)}"
            )
        _check_table(
            f"block_tables_headwise (layer {layer.index})",
            page_table,
            lo.reshape(-1),
            hi.reshape(-1),
            np.repeat(active, hkv),
            nb * hkv,
            "page",
        )
    else:
        _check_table("meta.block_tables", tables, lo.min(axis=1), hi[:, 0], active, nb, "block")
    _check_no_aliasing(meta, layer, page_table, tables, bid, cu, dec, lo, hi, active, bs)
    return HostMeta(dec, this_time, cu, tables, page_table, t)


def _check_no_aliasing(
    meta: BatchMeta,
    layer: LayerAttention,
    page_table: Any,
    tables: Any,
    bid: Any,
    cu: Any,
    dec: Any,
    lo: Any,
    hi: Any,
    active: Any,
    bs: int,
) -> None:
    """Write collisions and heads sharing a page (memoized per step and table: layers share it)."""
    import numpy as np

    hkv = layer.num_kv_heads
    table = tables if page_table is None else page_table
    key = ("aliasing", id(table), hkv, lo.tobytes(), hi.tobytes())
    done = meta.__dict__.setdefault("_aliasing_checked", set())
    if key in done:
        return
    pos = dec[bid] + (np.arange(bid.shape[0]) - cu[bid])  # absolute position of each packed token
    if page_table is None:
        _check_writes("meta.block_tables", tables, bid[:, None], pos, bs, "block")
    else:
        name = f"block_tables_headwise (layer {layer.index})"
        rows = bid[:, None] * hkv + np.arange(hkv)[None, :]
        _check_writes(name, page_table, rows, pos, bs, "page")
        cols = np.arange(page_table.shape[1])[None, :]
        lo_r, hi_r = lo.reshape(-1)[:, None], hi.reshape(-1)[:, None]
        used = np.repeat(active, hkv)[:, None] & (cols >= lo_r) & (cols <= hi_r)
        _check_page_heads(name, page_table, used, hkv)
    done.add(key)


def validate_shapes(
    q: Any,
    k: Any,
    v: Any,
    layer: LayerAttention,
    meta: BatchMeta,
    kv_cache: Any,
    sinks: Any = None,
) -> None:
    """The checks of :func:`validate_inputs` that need no host copy (shapes, dtypes, ranks, the
    metadata's lengths): safe inside a CUDA graph capture and on FastDeploy's hot path, where the
    metadata's values stay on the device. Raises ``ValueError`` / ``TypeError`` like it."""
    t = _check_operands(q, k, v, layer, meta, kv_cache)[0]
    hq = layer.num_q_heads
    bsz = _shape(meta.seq_lens_this_time)[0] if meta.seq_lens_this_time is not None else None
    if bsz is None:
        raise ValueError("meta.seq_lens_this_time is required, got None")
    for name, want in (("seq_lens_decoder", bsz), ("cu_seqlens_q", bsz + 1), ("batch_id_per_token", t)):
        x = getattr(meta, name)
        if x is None or _shape(x)[:1] != (want,):
            got = None if x is None else list(_shape(x))
            raise ValueError(f"meta.{name} must have length {want}, got shape {got}")
    if meta.block_tables is None or len(_shape(meta.block_tables)) != 2:
        got = None if meta.block_tables is None else list(_shape(meta.block_tables))
        raise ValueError(f"meta.block_tables must have shape [bsz={bsz}, max_blocks], got {got}")
    if layer.sink == "learnable" and (sinks is None or _shape(sinks) != (hq,)):
        got = None if sinks is None else list(_shape(sinks))
        raise ValueError(f"sinks must have shape [{hq}] for layer {layer.index}, got {got}")
