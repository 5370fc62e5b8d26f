"""Dense torch reference of the paged-attention math (tests and benchmarks).

Per request: dense K/V, an explicit visibility mask built from positions, the sink appended as an
extra score column that is dropped after the softmax. No paging, no online softmax, no tiles:
written to be obviously right, not fast.
"""

from __future__ import annotations

import torch


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    q_positions: torch.Tensor | None = None,
    window_left: int | None = None,
    sliding_heads: tuple[int, int] | None = None,
    sink_kind: str = "vanilla",
    sinks: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """One request. ``q [n, Hq, Dqk]`` at ``q_positions [n]`` (default: the last ``n`` positions),
    ``k [L, Hkv, Dqk]`` / ``v [L, Hkv, Dv]`` at positions ``0..L-1``. Key ``j`` is visible to query
    ``i`` iff ``j <= i`` and, for kv heads in ``sliding_heads`` (all when ``None``) with a window,
    ``i - j <= window_left``. ``sink_kind``: ``vanilla`` / ``off-by-one`` / ``learnable`` (``sinks
    [Hq]``). ``logits_soft_cap``: scores become ``cap * tanh(scores / cap)`` (sinks are not capped).
    Returns ``[n, Hq, Dv]`` in ``compute_dtype``; rows that see nothing are 0."""
    n, hq, _ = q.shape
    length, hkv, _ = v.shape
    g = hq // hkv
    dev = q.device
    if q_positions is None:
        q_positions = torch.arange(length - n, length, device=dev)
    qf = q.to(compute_dtype)
    kf = k.to(compute_dtype).repeat_interleave(g, dim=1)
    vf = v.to(compute_dtype).repeat_interleave(g, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", qf, kf) * scale  # [Hq, n, L]
    if logits_soft_cap is not None:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    i = q_positions.to(dev).long()[:, None]
    j = torch.arange(length, device=dev)[None, :]
    causal = j <= i  # [n, L]
    visible = causal[None].expand(hq, n, length).clone()
    if window_left is not None:
        h0, h1 = sliding_heads if sliding_heads is not None else (0, hkv)
        windowed = causal & (i - j <= window_left)
        visible[h0 * g : h1 * g] = windowed
    scores = scores.masked_fill(~visible, float("-inf"))
    if sink_kind != "vanilla":
        if sink_kind == "learnable":
            col = sinks.to(device=dev, dtype=compute_dtype)
        else:  # off-by-one: a zero logit
            col = torch.zeros(hq, device=dev, dtype=compute_dtype)
        scores = torch.cat([scores, col[:, None, None].expand(hq, n, 1)], dim=2)
    row_max = scores.amax(dim=2, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(scores - row_max)  # masked entries: exp(-inf) = 0
    den = e.sum(dim=2, keepdim=True)
    probs = e[:, :, :length] / torch.where(den > 0, den, torch.ones_like(den))
    return torch.einsum("hnl,lhd->nhd", probs, vf)


def gather_request_kv(
    cache: torch.Tensor, table_rows: torch.Tensor, length: int, *, headwise: bool
) -> torch.Tensor:
    """Positions ``0..length-1`` of one request from a paged ``cache [NB, Hkv, BS, D]`` ->
    ``[length, Hkv, D]``. ``table_rows``: the request's ``block_tables`` row ``[max_blocks]``, or
    with ``headwise=True`` its ``[Hkv, max_pages]`` page-table rows. Absent (-1) pages read as 0."""
    nb, hkv, bs, d = cache.shape
    pages_view = cache.reshape(nb * hkv, bs, d)
    pos = torch.arange(length, device=cache.device)
    if headwise:
        pages = table_rows[:, pos // bs].long()  # [Hkv, L]
    else:
        blocks = table_rows[pos // bs].long()[None, :]
        heads = torch.arange(hkv, device=cache.device)[:, None]
        pages = torch.where(blocks >= 0, blocks * hkv + heads, torch.full_like(blocks, -1))
    rows = pages_view[pages.clamp(min=0), (pos % bs)[None, :].expand_as(pages)]  # [Hkv, L, D]
    rows = torch.where((pages >= 0)[..., None], rows, torch.zeros_like(rows))
    return rows.transpose(0, 1)
