"""Window-aware prefix matching and the keep rule of a cached prefix (pure, stdlib only).

``docs/prefix_caching.md`` is the design; this module is its arithmetic, which the scheduler hook
(``serving/kv_recycling``) will call. Nothing here touches FastDeploy or any pool.

Terms
-----
* A *lane* is the unit a window releases at once (``LayerGroup.lanes``: one window per lane,
  ``None`` for full attention). ``windows`` is per group, per lane: ``[[w, ...], ...]``; a
  sequence of :class:`~.headwise.LayerGroup` is accepted too (their ``lanes``).
* ``held[g][j]`` says which logical blocks (block ``k`` holds tokens ``[k*bs, (k+1)*bs)``) lane
  ``j`` of group ``g`` has cached along one radix-tree path: either a set of block indices, or a
  sequence indexed by logical block whose entries are unit ids (``>= 0`` held, ``-1`` / ``None``
  absent; blocks past its end absent), i.e. what ``HeadwiseKVManager.lane_ids`` gives.

Rule (serving a prefix of ``L = m * bs`` tokens)
------------------------------------------------
The request then runs queries ``L, L+1, ...``; a lane with ``window_left = w`` lets query ``i``
see keys ``[i - w, i]``, so it needs the blocks ``[first_needed(w, L), m)`` with
``first_needed(w, L) = max(0, L - w) // bs`` (a full lane: ``[0, m)``). That is exactly the
release rule (``headwise``: a lane at computed bound ``c`` has released the blocks below
``max(0, c - w) // bs``), so a request served at ``L`` starts in the state a request that computed
``L`` tokens itself would be in: entries below the window are ``-1`` as released entries are.
``L`` is *servable* when every lane holds all the blocks it needs; :func:`servable_tokens` returns
the largest servable ``L`` up to a limit (``0`` is always servable: nothing is needed).

Servability is not monotone in ``L`` (a sliding lane that dropped its early blocks serves a long
``L`` but not a short one), so the search walks ``m`` downwards from the limit and skips, at each
failing ``m``, to the largest block ``k`` the failing lane misses inside its needed range: every
``m'`` in ``(k, m]`` needs ``k`` too (``first_needed`` never decreases with ``m``), so only
failing candidates are skipped and the first ``m`` that passes is the largest.

Keep rule (a request finishes, is aborted or preempted)
-------------------------------------------------------
Of a path cached up to ``C`` full blocks, a later request can only ever be served at a servable
``m <= C`` (a longer prompt is limited by the path, a shorter one by itself); lane ``j`` of such a
request uses ``[first_needed(w_j, m*bs), m)``. :func:`keep_plan` keeps, per lane, the union of
those ranges over every servable ``m in [1, C]`` and frees every other held block (including any
block at or past ``C``: partial blocks and look-ahead are never cached). Freeing them changes no
servable ``m`` (none of them is needed by one), and no kept block is useless.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "KeepPlan",
    "first_needed",
    "keep_plan",
    "lane_windows",
    "match_limit",
    "needed_blocks",
    "servable",
    "servable_blocks",
    "servable_tokens",
]


def _int(name: str, value: Any, lo: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name}={value!r}: expected an int >= {lo}")
    return value


def lane_windows(groups: Iterable[Any]) -> list[list[int | None]]:
    """Per group, the windows of its lanes: ``LayerGroup.lanes``, or a sequence of windows as is."""
    out = []
    for gi, g in enumerate(groups):
        lanes = getattr(g, "lanes", g)
        ws = []
        for j, w in enumerate(lanes):
            if w is not None:
                _int(f"window of group {gi} lane {j}", w)
            ws.append(w)
        out.append(ws)
    return out


def first_needed(window: int | None, block_size: int, tokens: int) -> int:
    """The first logical block a query at position ``tokens`` (or later) sees through a lane with
    ``window_left = window`` (``None``: full, 0); the blocks below it are the ones the release rule
    has given back at computed bound ``tokens`` (``headwise._Lane.release_target``)."""
    if window is None:
        return 0
    return max(0, tokens - window) // block_size


def needed_blocks(window: int | None, block_size: int, tokens: int) -> range:
    """Logical blocks a lane must hold to serve a prefix of ``tokens`` (a multiple of ``block_size``)."""
    return range(first_needed(window, block_size, tokens), tokens // block_size)


def match_limit(num_tokens: int, block_size: int) -> int:
    """The largest prefix FastDeploy serves from cache for a request of ``num_tokens`` to prefill:
    whole blocks, and at least one token left to compute (``get_prefix_cached_blocks`` reverts a
    full match by one block; matching below that keeps FastDeploy from reverting)."""
    n = _int("num_tokens", num_tokens)
    bs = _int("block_size", block_size, 1)
    return 0 if n == 0 else (n - 1) // bs * bs


def _mask(held: Any, n: int) -> list[bool]:
    """``held`` (a set of blocks, or unit ids by block) as ``n`` booleans."""
    if isinstance(held, set | frozenset):
        return [k in held for k in range(n)]
    out = [False] * n
    for k, unit in enumerate(held):
        if k >= n:
            break
        out[k] = unit is not None and unit >= 0
    return out


def _held_set(held: Any) -> set[int]:
    if isinstance(held, set | frozenset):
        return {k for k in held if k >= 0}
    return {k for k, unit in enumerate(held) if unit is not None and unit >= 0}


def _runs(mask: list[bool]) -> list[int]:
    """``run[k]``: length of the run of held blocks ending at block ``k`` (0: ``k`` absent)."""
    run, n = [], 0
    for h in mask:
        n = n + 1 if h else 0
        run.append(n)
    return run


def _lanes(windows: Any, held: Any) -> list[tuple[int | None, Any]]:
    ws = lane_windows(windows)
    if len(held) != len(ws):
        raise ValueError(f"held has {len(held)} groups, windows {len(ws)}")
    out = []
    for gi, (lanes, hs) in enumerate(zip(ws, held, strict=True)):
        if len(hs) != len(lanes):
            raise ValueError(f"group {gi}: held has {len(hs)} lanes, windows {len(lanes)}")
        out += list(zip(lanes, hs, strict=True))
    return out


def _check_runs(lanes: list[tuple[int | None, list[int]]], bs: int, m: int) -> int | None:
    """``None`` when every lane holds what serving ``m`` blocks needs, else the largest block a
    failing lane misses inside its needed range (every ``m'`` in ``(k, m]`` fails too)."""
    for w, run in lanes:
        need = m - first_needed(w, bs, m * bs)
        have = run[m - 1]
        if have < need:
            return m - 1 - have
    return None


def servable_tokens(windows: Any, held: Sequence[Sequence[Any]], block_size: int, limit_tokens: int) -> int:
    """The largest ``L <= limit_tokens`` (a multiple of ``block_size``) every lane can serve from
    ``held`` (module docstring). ``limit_tokens``: the token-matched depth of the radix-tree path
    and :func:`match_limit` of the request, whichever is smaller."""
    bs = _int("block_size", block_size, 1)
    top = _int("limit_tokens", limit_tokens) // bs
    lanes = [(w, _runs(_mask(h, top))) for w, h in _lanes(windows, held)]
    m = top
    while m > 0:
        k = _check_runs(lanes, bs, m)
        if k is None:
            return m * bs
        m = k
    return 0


def servable(windows: Any, held: Sequence[Sequence[Any]], block_size: int, tokens: int) -> bool:
    """Whether every lane holds the blocks serving a prefix of ``tokens`` needs (``tokens`` a
    multiple of ``block_size``)."""
    bs = _int("block_size", block_size, 1)
    if _int("tokens", tokens) % bs:
        raise ValueError(f"tokens={tokens!r}: expected a multiple of block_size={bs}")
    return all(set(needed_blocks(w, bs, tokens)) <= _held_set(h) for w, h in _lanes(windows, held))


def servable_blocks(
    windows: Any, held: Sequence[Sequence[Any]], block_size: int, limit_tokens: int
) -> list[int]:
    """Every servable ``m`` in ``[1, limit_tokens // block_size]`` (ascending), in blocks."""
    bs = _int("block_size", block_size, 1)
    top = _int("limit_tokens", limit_tokens) // bs
    lanes = [(w, _runs(_mask(h, top))) for w, h in _lanes(windows, held)]
    return [m for m in range(1, top + 1) if _check_runs(lanes, bs, m) is None]


@dataclass(frozen=True)
class KeepPlan:
    """What stays cached of one path and what goes back to the pool, per group and lane.

    ``servable``: the prefix lengths (tokens) a later request can be served at from what is kept
    (``0`` excluded); ``keep[g][j]`` / ``free[g][j]``: sorted logical blocks of lane ``j`` of group
    ``g`` kept cached / freed at once (frozensets: the set form of ``held``, so ``keep`` can be
    matched on as it is). ``keep`` and ``free`` split the blocks held.
    """

    servable: tuple[int, ...]
    keep: tuple[tuple[frozenset[int], ...], ...]
    free: tuple[tuple[frozenset[int], ...], ...]

    @property
    def kept_units(self) -> int:
        return sum(len(b) for lanes in self.keep for b in lanes)

    @property
    def freed_units(self) -> int:
        return sum(len(b) for lanes in self.free for b in lanes)


def keep_plan(windows: Any, held: Sequence[Sequence[Any]], block_size: int, cached_tokens: int) -> KeepPlan:
    """The keep rule (module docstring) for a path whose first ``cached_tokens // block_size``
    blocks are in the radix tree, with ``held`` what each lane still holds along it."""
    bs = _int("block_size", block_size, 1)
    top = _int("cached_tokens", cached_tokens) // bs
    ms = servable_blocks(windows, held, bs, top * bs)
    ws = lane_windows(windows)
    keep_out, free_out = [], []
    for lanes, hs in zip(ws, held, strict=True):
        gk, gf = [], []
        for w, h in zip(lanes, hs, strict=True):
            # union of [first_needed(m), m) over servable m: both ends grow with m, merge in order
            spans: list[list[int]] = []
            for m in ms:
                lo = first_needed(w, bs, m * bs)
                if lo >= m:
                    continue
                if spans and lo <= spans[-1][1]:
                    spans[-1][1] = m
                else:
                    spans.append([lo, m])
            kept = {k for a, b in spans for k in range(a, b)}
            have = _held_set(h)
            gk.append(frozenset(kept))
            gf.append(frozenset(have - kept))
        keep_out.append(tuple(gk))
        free_out.append(tuple(gf))
    return KeepPlan(tuple(m * bs for m in ms), tuple(keep_out), tuple(free_out))
