"""Dense attention in numpy float64, for tests: no paging, an explicit mask, the sink as a column.

Independent of the backends on purpose: one sequence's full K/V as dense
arrays, a boolean visibility mask built from positions, the sink appended as
an extra score column that is dropped after the softmax.
"""

from __future__ import annotations

import numpy as np


def visibility(q_pos: np.ndarray, k_pos: np.ndarray, window_left: int | None) -> np.ndarray:
    """``[n, L]`` bool: key ``j`` visible to query ``i`` iff ``j <= i`` and ``i - j <= window_left``."""
    i, j = q_pos[:, None], k_pos[None, :]
    mask = j <= i
    if window_left is not None:
        mask &= i - j <= window_left
    return mask


def dense_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    q_pos0: int,
    *,
    scale: float,
    windows: list[int | None],
    sinks: np.ndarray | None,
    logits_soft_cap: float | None = None,
) -> np.ndarray:
    """One sequence. ``q [n, Hq, Dqk]`` at positions ``q_pos0..``; ``k [L, Hkv, Dqk]``,
    ``v [L, Hkv, Dv]`` at positions ``0..L-1``; ``windows[h]`` per kv head; ``sinks [Hq]``
    logits or ``None``; ``logits_soft_cap``: scores become ``cap * tanh(scores / cap)`` before the
    mask and the sink (the sink is not capped). Returns ``[n, Hq * Dv]`` float64."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    n, hq, _ = q.shape
    length, hkv, dv = v.shape
    group = hq // hkv
    q_pos = q_pos0 + np.arange(n)
    out = np.zeros((n, hq, dv))
    for head in range(hq):
        h = head // group
        scores = scale * q[:, head] @ k[:, h].T  # [n, L]
        if logits_soft_cap is not None:
            scores = logits_soft_cap * np.tanh(scores / logits_soft_cap)
        mask = visibility(q_pos, np.arange(length), windows[h])
        scores = np.where(mask, scores, -np.inf)
        if sinks is not None:
            scores = np.concatenate([scores, np.full((n, 1), float(sinks[head]))], axis=1)
        row_max = scores.max(axis=1, keepdims=True)
        live = np.isfinite(row_max[:, 0])  # rows with nothing visible and no sink stay 0
        e = np.exp(scores[live] - row_max[live])
        probs = e / e.sum(axis=1, keepdims=True)
        out[live, head] = probs[:, :length] @ v[:, h]
    return out.reshape(n, hq * dv)
