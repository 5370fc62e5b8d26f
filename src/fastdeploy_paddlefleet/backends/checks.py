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

from ..kvcache.quant import KVCacheQuant
from ..plan.layer import LayerAttention
from .base import BatchMeta, QuantizedKVCache

#: dtypes q/k/v and the cache may have (the part of ``str(dtype)`` after the last dot)
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
#: dtypes the integer metadata may have (the kernels read int32: wider ones are range-checked first)
INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
#: the integer ``BatchMeta`` fields the kernels read as int32
META_INT_FIELDS = (
    "seq_lens_encoder",
    "seq_lens_decoder",
    "seq_lens_this_time",
    "cu_seqlens_q",
    "batch_id_per_token",
    "block_tables",
    "block_tables_headwise",
)
#: the cache axes a zero stride would alias (``[num_blocks, Hkv, block_size, D]``)
CACHE_AXES = ("blocks", "kv heads", "slots", "channels")


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

    ``TypeError`` for metadata that is not integer (a float table would be truncated: 2.7 -> 2),
    ``ValueError`` for values the kernels' int32 would wrap (a page id 2**32 read as 0)."""
    cache = meta.__dict__.setdefault("_host_arrays", {})
    hit = cache.get(name)
    if hit is None or hit[0] is not x:  # keyed on the object: a replaced field is copied again
        field = "meta." + name.split("@")[0].replace("page_table", "block_tables_headwise")
        check_int_dtype(field, x)
        a = to_numpy(x)
        check_int32_range(field, a)
        hit = cache[name] = (x, a.astype("int64", copy=False))
    return hit[1]


def _int_dtype_name(x: Any) -> str:
    """The dtype name of a tensor, numpy array or (nested) list of metadata."""
    import numpy as np

    return dtype_name(x.dtype) if hasattr(x, "dtype") else str(np.asarray(x).dtype)


def check_int_dtype(name: str, x: Any) -> None:
    """Integer metadata only (O(1), no sync): a float ``block_tables`` or ``seq_lens_*`` would be
    truncated by the cast to int32 (2.7 -> 2), a bool read as 0 / 1. ``TypeError`` naming ``name``."""
    got = _int_dtype_name(x)
    if got not in INT_DTYPES:
        raise TypeError(f"{name} must hold integers (int32), got dtype {got}")


def check_int32_range(name: str, a: Any) -> None:
    """Every value of the host array ``a`` fits int32, the kernels' index type: a wider value is
    refused, never wrapped (2**32 would become page 0). ``ValueError`` naming the entry and value."""
    import numpy as np

    a = np.asarray(a)
    if (a.dtype.kind == "i" and a.dtype.itemsize <= 4) or a.size == 0:
        return
    bad = (a < INT32_MIN) | (a > INT32_MAX)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        where = f"[{', '.join(map(str, idx))}]" if idx else ""
        raise ValueError(
            f"{name}{where} = {int(a[idx])} is outside int32 [{INT32_MIN}, {INT32_MAX}]: the kernels index "
            "with int32 (refused, not wrapped)"
        )


def is_on_host(x: Any) -> bool:
    """Whether reading ``x``'s values needs no device sync (numpy, lists, CPU tensors)."""
    if not hasattr(x, "dtype") or type(x).__module__.split(".")[0] == "numpy":
        return True
    device = getattr(x, "device", None)
    if getattr(device, "type", None) == "cpu":  # torch
        return True
    place = getattr(x, "place", None)  # paddle
    return bool(place is not None and (place.is_cpu_place() or place.is_cuda_pinned_place()))


def check_int32_narrowing(name: str, x: Any) -> None:
    """Whether ``x`` may be narrowed to int32 without a wrap, at no sync: int32 (or narrower) passes;
    a wider dtype is range-checked where the host holds the values and refused on a device (its
    values cannot be read without a sync: pass int32). ``TypeError`` / ``ValueError`` naming ``name``."""
    got = _int_dtype_name(x)
    if got in ("int8", "int16", "int32", "uint8", "uint16"):
        return
    if not is_on_host(x):
        raise TypeError(
            f"{name} is {got} on {getattr(x, 'place', getattr(x, 'device', '?'))}: the kernels read int32 "
            "and served mode cannot range-check device values without a sync; pass int32"
        )
    check_int32_range(name, to_numpy(x))


def check_token_ids(name: str, ids: Any, vocab_size: int | None) -> None:
    """Token ids are integers in ``[0, vocab_size)``: a float dtype is refused (``TypeError``; the
    cast to int64 would truncate 1.7 to 1), and where the host holds the values (lists, numpy, CPU
    tensors) an id below 0 or at / past ``vocab_size`` is refused (``ValueError`` naming the entry,
    the id and ``vocab_size``): the embedding would gather a row that is not there (-1 reads memory
    before the table, a sharded table gives zeros). Device values are not read (no sync); a
    ``vocab_size`` of ``None`` (unknown) checks the dtype only."""
    got = _int_dtype_name(ids)
    if got not in INT_DTYPES:
        raise TypeError(f"{name} must hold integer token ids, got dtype {got}")
    if vocab_size is None or not is_on_host(ids):
        return
    import numpy as np

    a = np.asarray(to_numpy(ids))
    if a.size == 0:
        return
    bad = (a < 0) | (a >= vocab_size)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        where = f"[{', '.join(map(str, idx))}]" if idx else ""
        raise ValueError(
            f"{name}{where} = {int(a[idx])} is not a token id: expected an int in [0, vocab_size="
            f"{vocab_size})"
        )


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


def _row_name(row: int, hkv: int | None) -> str:
    """``request b`` for a per-request table, ``request b kv head h`` for a head-wise row."""
    return f"request {row}" if hkv is None else f"request {row // hkv} kv head {row % hkv} (row {row})"


def _check_logical_aliasing(name: str, table: Any, used: Any, unit: str, hkv: int | None) -> None:
    """No two logical blocks of one row (one request, or one request's kv head) that a step reads or
    writes on one physical block / page: the newer keys would overwrite the older ones."""
    import numpy as np

    r, c = np.nonzero(used)
    if r.size < 2:
        return
    vals = table[r, c]
    order = np.lexsort((c, vals, r))
    rr, vv, cc = r[order], vals[order], c[order]
    dup = (rr[1:] == rr[:-1]) & (vv[1:] == vv[:-1])
    if dup.any():
        i = int(np.argmax(dup))
        raise ValueError(
            f"{name}: {unit} {int(vv[i])} appears twice in row {int(rr[i])} ({_row_name(int(rr[i]), hkv)}): "
            f"logical blocks {int(cc[i])} and {int(cc[i + 1])} on one {unit}"
        )


def _check_written_owned(name: str, table: Any, used: Any, written: Any, unit: str, hkv: int | None) -> None:
    """A block / page written this step belongs to the one row writing it: it is in no other row's
    range this step (prefix sharing shares only full, read-only blocks). ``used`` / ``written``:
    ``[rows, cols]`` masks of the entries each row reads or writes / writes."""
    import numpy as np

    wr, wc = np.nonzero(written)
    if wr.size == 0:
        return
    wp = table[wr, wc]
    pages, first = np.unique(wp, return_index=True)
    owner = wr[first]
    ur, uc = np.nonzero(used)
    up = table[ur, uc]
    at = np.minimum(np.searchsorted(pages, up), pages.size - 1)
    foreign = (pages[at] == up) & (owner[at] != ur)
    if foreign.any():
        i = int(np.argmax(foreign))
        w, u = int(owner[at[i]]), int(ur[i])
        writes = bool(written[u, uc[i]])
        raise ValueError(
            f"{name}: {unit} {int(up[i])} is written this step by {_row_name(w, hkv)} and "
            f"{'also written' if writes else 'read'} by {_row_name(u, hkv)} (logical block {int(uc[i])}): "
            f"a {unit} being written belongs to one request"
        )


def _check_page_heads(name: str, table: Any, used: Any, hkv: int) -> None:
    """A page holds one kv head's keys: the pages a step reads or writes may repeat across rows only for
    the same kv head (shared prefixes), never across heads."""
    import numpy as np

    r, c = np.nonzero(used)
    if r.size < 2:
        return
    pages, heads = table[r, c], r % hkv
    order = np.lexsort((r, pages))
    p, h, rr = pages[order], heads[order], r[order]
    clash = (p[1:] == p[:-1]) & (h[1:] != h[:-1])
    if clash.any():
        i = int(np.argmax(clash))
        raise ValueError(
            f"{name}: page {int(p[i])} is mapped to row {int(rr[i])} (kv head {int(h[i])}) and row "
            f"{int(rr[i + 1])} (kv head {int(h[i + 1])}); a page holds one head's keys"
        )


def _strides(x: Any) -> tuple[int, ...]:
    """Element strides of a paddle / torch tensor."""
    st = x.stride() if callable(getattr(x, "stride", None)) else x.strides
    return tuple(int(s) for s in st)


def check_cache_strides(name: str, cache: Any) -> None:
    """No zero stride on an axis of ``cache [num_blocks, Hkv, block_size, D]`` with more than one entry
    (O(1)): a broadcast view would map every block / head / slot onto one memory row, so a write to one
    would silently overwrite the others. ``ValueError`` naming the cache, axis and strides."""
    strides = _strides(cache)
    for axis, (size, st) in enumerate(zip(_shape(cache), strides, strict=True)):
        if st == 0 and size > 1:
            raise ValueError(
                f"{name} has stride 0 on axis {axis} ({CACHE_AXES[axis]}; strides {list(strides)}, shape "
                f"{list(_shape(cache))}): its {size} {CACHE_AXES[axis]} would share one memory row"
            )


def _data_ptr(x: Any) -> int | None:
    try:
        return int(x.data_ptr())
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None


def check_distinct_caches(key_cache: Any, value_cache: Any) -> None:
    """K and V caches are distinct tensors (O(1): identity and data pointer): one tensor passed as both
    would have every value write overwrite the keys. ``ValueError`` naming both."""
    same = key_cache is value_cache
    if not same:
        pk, pv = _data_ptr(key_cache), _data_ptr(value_cache)
        same = pk is not None and pk == pv and pk != 0
    if same:
        raise ValueError(
            "kv_cache[0] (key cache) and kv_cache[1] (value cache) are the same tensor (or start at the "
            "same memory): K and V caches must be distinct tensors"
        )


def _check_codes(name: str, x: Any, expected: tuple[int | None, ...]) -> int:
    """A quantized cache's code tensor: a paddle / torch ``uint8`` tensor of shape ``expected``
    (``None`` = any); returns its first size."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype") or type(x).__module__.split(".")[0] == "numpy":
        raise TypeError(f"{name} must be a paddle or torch tensor, got {type(x).__name__}")
    if dtype_name(x.dtype) != "uint8":
        raise TypeError(f"{name} must hold uint8 codes, got {name}.dtype={x.dtype}")
    shape = _shape(x)
    if len(shape) != len(expected) or any(
        w is not None and g != w for g, w in zip(shape, expected, strict=True)
    ):
        raise ValueError(f"{name} must have shape {list(expected)}, got {name}.shape={list(shape)}")
    check_cache_strides(name, x)
    return shape[0]


def _check_quant_multipliers(cache: Any, fmt: KVCacheQuant, model_dtype: Any) -> None:
    """A static cache's quant multipliers (FastDeploy's ``cache_k_scale`` / ``cache_v_scale``), if any."""
    mults = (getattr(cache, "key_quant_scale", None), getattr(cache, "value_quant_scale", None))
    if mults == (None, None):
        return
    if None in mults:
        lone = "kv_cache.key_quant_scale" if mults[0] is not None else "kv_cache.value_quant_scale"
        raise ValueError(f"{lone} is given alone: the quant multipliers come as a K and V pair")
    if fmt.dynamic:
        raise ValueError(
            f"kv_cache.key_quant_scale / value_quant_scale are given for {fmt.name}, which computes its "
            "quant multipliers per token: only static formats take them"
        )
    for name, m, sc in (
        ("kv_cache.key_quant_scale", mults[0], cache.key_scale),
        ("kv_cache.value_quant_scale", mults[1], cache.value_scale),
    ):
        if not hasattr(m, "shape") or not hasattr(m, "dtype") or type(m).__module__.split(".")[0] == "numpy":
            raise TypeError(f"{name} must be a paddle or torch tensor, got {type(m).__name__}")
        if _shape(m) != _shape(sc):
            raise ValueError(
                f"{name} must have the dequant multipliers' shape {list(_shape(sc))}, got {list(_shape(m))}"
            )
        if dtype_name(m.dtype) != dtype_name(model_dtype):
            raise TypeError(
                f"{name}.dtype={m.dtype} must be the model dtype {model_dtype} (FastDeploy's cache_k_scale "
                "is a model-dtype parameter, multiplied by as it is)"
            )


def check_quantized_cache(cache: Any, hkv: int, block_size: int, dqk: int, dv: int, model_dtype: Any) -> int:
    """A :class:`~.base.QuantizedKVCache` (O(1), no sync): ``uint8`` codes ``[num_blocks, Hkv, block_size,
    D]``; a dynamic format's dequant scales ``[num_blocks, Hkv, block_size]`` in the model dtype (K's:
    FastDeploy keeps them in ``paddle.get_default_dtype()``), a static format's ``[Hkv]`` or (per channel)
    ``[Hkv * D]`` of any float dtype, and its optional quant multipliers (``key_quant_scale`` /
    ``value_quant_scale``: both or neither, static formats only, the dequant multipliers' shapes, the
    model dtype); the tensors written (codes, dynamic scales) distinct. Returns ``num_blocks``;
    ``TypeError`` / ``ValueError`` naming the field and its value."""
    if not isinstance(cache.quant, KVCacheQuant):
        raise TypeError(f"kv_cache.quant must be a KVCacheQuant, got {type(cache.quant).__name__}")
    fmt = cache.quant
    nb = _check_codes("kv_cache.key (codes)", cache.key, (None, hkv, block_size, dqk))
    _check_codes("kv_cache.value (codes)", cache.value, (nb, hkv, block_size, dv))
    written = [("kv_cache.key", cache.key), ("kv_cache.value", cache.value)]
    for name, sc, d in (
        ("kv_cache.key_scale", cache.key_scale, dqk),
        ("kv_cache.value_scale", cache.value_scale, dv),
    ):
        if fmt.dynamic:
            want: tuple[int, ...] = (nb, hkv, block_size)
        else:
            want = (hkv * d,) if fmt.channel_wise else (hkv,)
        if (
            not hasattr(sc, "shape")
            or not hasattr(sc, "dtype")
            or type(sc).__module__.split(".")[0] == "numpy"
        ):
            raise TypeError(
                f"{name} must be a paddle or torch tensor for {fmt.name}, got {type(sc).__name__}"
            )
        if _shape(sc) != want:
            raise ValueError(f"{name} must have shape {list(want)} for {fmt.name}, got {list(_shape(sc))}")
        got = dtype_name(sc.dtype)
        if got not in FLOAT_DTYPES:
            raise TypeError(f"{name} must have a float dtype {FLOAT_DTYPES}, got {name}.dtype={sc.dtype}")
        if fmt.dynamic:
            if got != dtype_name(model_dtype):
                raise TypeError(
                    f"{name}.dtype={sc.dtype} must be the model dtype {model_dtype} for {fmt.name} (the "
                    "write rounds its scales to it)"
                )
            strides = _strides(sc)
            for axis, (size, st) in enumerate(zip(_shape(sc), strides, strict=True)):
                if st == 0 and size > 1:
                    raise ValueError(f"{name} has stride 0 on axis {axis} (strides {list(strides)})")
            written.append((name, sc))
    _check_quant_multipliers(cache, fmt, model_dtype)
    for i, (name, x) in enumerate(written):  # a write through one would overwrite another
        for other, y in written[:i]:
            p = _data_ptr(x)
            if x is y or (p and p == _data_ptr(y)):
                raise ValueError(f"{name} and {other} are the same tensor (or start at the same memory)")
    return nb


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
    if isinstance(kv_cache, QuantizedKVCache):
        nb = check_quantized_cache(kv_cache, hkv, bs, dqk, dv, q.dtype)
        return t, nb, bs
    if not isinstance(kv_cache, (tuple, list)) or len(kv_cache) != 2:
        raise TypeError(f"kv_cache must be a (key_cache, value_cache) pair, got {type(kv_cache).__name__}")
    nb = _check_tensor("kv_cache[0] (key cache)", kv_cache[0], (None, hkv, bs, dqk))[0]
    _check_tensor("kv_cache[1] (value cache)", kv_cache[1], (nb, hkv, bs, dv))
    if dtype_name(kv_cache[0].dtype) != dtype_name(kv_cache[1].dtype):
        raise TypeError(
            f"key and value caches must share one dtype, got {kv_cache[0].dtype} and {kv_cache[1].dtype}"
        )
    if dtype_name(kv_cache[0].dtype) != dtype_name(q.dtype):  # no silent rounding into the cache
        raise TypeError(f"kv_cache dtype must match q ({q.dtype}), got {kv_cache[0].dtype}")
    check_distinct_caches(kv_cache[0], kv_cache[1])
    check_cache_strides("kv_cache[0] (key cache)", kv_cache[0])
    check_cache_strides("kv_cache[1] (value cache)", kv_cache[1])
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
    enc = _int_array(meta, "seq_lens_encoder", bsz)
    cu = _int_array(meta, "cu_seqlens_q", bsz + 1)
    for name, a in (("seq_lens_this_time", this_time), ("seq_lens_decoder", dec), ("seq_lens_encoder", enc)):
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
    """Aliasing of one step's table (memoized per step and table: layers share it): write collisions,
    two logical blocks of a row on one block / page, a block / page written by one row and used by
    another, heads sharing a page."""
    import numpy as np

    hkv = layer.num_kv_heads
    table = tables if page_table is None else page_table
    key = ("aliasing", id(table), hkv, lo.tobytes(), hi.tobytes())
    done = meta.__dict__.setdefault("_aliasing_checked", set())
    if key in done:
        return
    pos = dec[bid] + (np.arange(bid.shape[0]) - cu[bid])  # absolute position of each packed token
    cols = np.arange(table.shape[1])[None, :]
    if page_table is None:
        name, unit, row_hkv = "meta.block_tables", "block", None
        rows, act, first, lo_r, hi_r = bid[:, None], active, dec // bs, lo.min(axis=1), hi[:, 0]
    else:
        name, unit, row_hkv = f"block_tables_headwise (layer {layer.index})", "page", hkv
        rows = bid[:, None] * hkv + np.arange(hkv)[None, :]
        act, first = np.repeat(active, hkv), np.repeat(dec // bs, hkv)
        lo_r, hi_r = lo.reshape(-1), hi.reshape(-1)
    _check_writes(name, table, rows, pos, bs, unit)
    used = act[:, None] & (cols >= lo_r[:, None]) & (cols <= hi_r[:, None])
    written = used & (cols >= first[:, None])
    _check_logical_aliasing(name, table, used, unit, row_hkv)
    _check_written_owned(name, table, used, written, unit, row_hkv)
    if page_table is not None:
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
    metadata's lengths and integer dtypes, caches distinct and without zero strides): safe inside a
    CUDA graph capture and on FastDeploy's hot path, where the metadata's values stay on the device
    (int64 metadata is range-checked only where the host holds it, refused on a device). Raises
    ``ValueError`` / ``TypeError`` like it."""
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
    page_table = meta.headwise_table(layer.index)
    for name in META_INT_FIELDS:
        x = page_table if name == "block_tables_headwise" else getattr(meta, name)
        if x is not None:
            check_int_dtype(f"meta.{name}", x)
            check_int32_narrowing(f"meta.{name}", x)
    if layer.sink == "learnable" and (sinks is None or _shape(sinks) != (hq,)):
        got = None if sinks is None else list(_shape(sinks))
        raise ValueError(f"sinks must have shape [{hq}] for layer {layer.index}, got {got}")
