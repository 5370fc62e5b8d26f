"""Shared-prefix traces through FastDeploy's REAL ``ResourceManagerV1`` with prefix caching on and
window recycling on, checked token by token (imported by ``test_prefix_caching_scheduler.py``'s
child processes, the host on ``sys.path``).

The checker is independent of the code under test: it knows every request's tokens (prompts are
built here, output token ``i`` of request ``r`` is :func:`out_token` ``(r, i)`` on both sides) and
keeps, per unit of the one pool, WHICH token of WHICH context each slot holds: the chain hash of
the tokens ``[0, p]`` of the sequence that wrote position ``p`` (two requests share a hash exactly
when they share the whole prefix up to that token). Its unit tables come only from the tasks'
``KVDelta`` (what the real worker receives). Per batch (writes of the batch first, then reads, as
a layer writes the batch's K/V before attending):

* writes: each written position maps to a unit in the writer's own rows; no other live request
  maps that unit at a slot where it expects other content (nobody's data is overwritten);
* reads: for every query of the batch, every key inside its window (full lanes: the whole prefix)
  maps to a unit holding exactly that token of that context (written by this request or by the
  one that cached it);

and per ``schedule()`` on the engine side: held + cached + free = pool (distinct units; a shared
unit counts once), no held or cached unit is free; at the end every unit is free or cached.
"""

from __future__ import annotations

import pickle
import random
import zlib
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

from _scheduler_sim import SimError

from fastdeploy_paddlefleet.serving.kv_recycling.protocol import TASK_ATTR
from fastdeploy_paddlefleet.serving.kv_recycling.scheduler import recycler_of


def out_token(rid: str, i: int) -> int:
    """Output token ``i`` of request ``rid`` (the worker emits it, the engine appends it)."""
    return 2 + zlib.crc32(f"{rid}:{i}".encode()) % 30000


def chain(tokens: list[int]) -> list[int]:
    """``h[p]``: identity of token ``p`` in the context ``tokens[:p + 1]``."""
    out, h = [], 0
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


def build_request(rid: str, prompt: list[int], max_tokens: int) -> Any:
    from fastdeploy.engine.request import Request
    from fastdeploy.engine.sampling_params import SamplingParams

    return Request(
        request_id=rid,
        prompt_token_ids=list(prompt),
        prompt_token_ids_len=len(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens),
        eos_token_ids=[0],
    )


@dataclass
class Trace:
    arrivals: list[tuple[int, str, list[int], int]]  # (step, rid, prompt, max_tokens)
    aborts: dict[int, list[str]] = field(default_factory=dict)


def _fresh(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(30002, 60000) for _ in range(n)]


def shared_trace(seed: int, window: int, n: int, max_len: int, aborts: float = 0.1, gap: int = 6) -> Trace:
    """System prompts of 0.5 to 20 windows shared by several requests, multi-turn conversations
    re-sending their history (outputs included), identical prompts arriving together, aborts."""
    rng = random.Random(seed)
    arrivals: list[tuple[int, str, list[int], int]] = []
    abort_at: dict[int, list[str]] = {}
    systems = [_fresh(rng, max(8, min(int(window * f), max_len // 2))) for f in (0.5, 1, 2, 5, 10, 20)]
    step, i = 0, 0
    while len(arrivals) < n:
        kind = rng.random()
        if kind < 0.4:  # a request on a system prompt
            prompt = rng.choice(systems) + _fresh(rng, rng.randint(1, 40))
            arrivals.append((step, f"s{seed}-{i}", prompt[: max_len - 80], rng.randint(1, 60)))
        elif kind < 0.7:  # a conversation of 2 to 4 turns, each re-sending the history
            rid = f"c{seed}-{i}"
            prompt = rng.choice([[], rng.choice(systems)]) + _fresh(rng, rng.randint(4, 60))
            at = step
            for turn in range(rng.randint(2, 4)):
                out = rng.randint(4, 50)
                if len(prompt) + out > max_len - 20:
                    break
                trid = f"{rid}-t{turn}"
                arrivals.append((at, trid, list(prompt), out))
                prompt = prompt + [out_token(trid, k) for k in range(out)] + _fresh(rng, rng.randint(4, 40))
                at += rng.randint(out // 2 + 5, out + 60)
        elif kind < 0.85:  # identical prompts arriving together
            prompt = rng.choice([[], rng.choice(systems)]) + _fresh(rng, rng.randint(20, 200))
            for c in range(rng.randint(2, 4)):
                arrivals.append((step, f"i{seed}-{i}-{c}", prompt[: max_len - 80], rng.randint(1, 40)))
        else:  # unrelated
            arrivals.append((step, f"u{seed}-{i}", _fresh(rng, rng.randint(4, 300)), rng.randint(1, 80)))
        if rng.random() < aborts:
            abort_at.setdefault(step + rng.randint(0, 40), []).append(arrivals[-1][1])
        i += 1
        step += rng.randint(0, gap)
    return Trace(sorted(arrivals, key=lambda a: a[0]), abort_at)


def distinct_trace(seed: int, n: int, prompt: int, out: int) -> Trace:
    """``n`` requests of distinct random prompts, all at once (no sharing at all)."""
    rng = random.Random(seed)
    return Trace([(0, f"d{seed}-{i}", _fresh(rng, prompt), out) for i in range(n)])


@dataclass
class Slot:
    rid: str
    prompt_len: int
    max_tokens: int
    length: int = 0
    blocks: int = 0
    chunk: tuple[int, int] | None = None
    decoding: bool = False
    produced: int = 0
    need: int = 0


class CheckingWorker:
    """The worker: unit tables from the deltas only, slot contents by token identity."""

    def __init__(self, bs: int, windows: list[list[int | None]], check: bool = True) -> None:
        self.bs = bs
        self.windows = windows
        self.check = check
        self.rows: dict[str, list[list[list[int]]]] = {}
        self.maps: dict[int, set[tuple[str, int, int, int]]] = defaultdict(set)
        self.content: dict[int, list[int | None]] = {}
        self.hashes: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.slots: dict[int, Slot] = {}
        self.done: set[str] = set()
        self.queries = 0
        self.keys_checked = 0
        self.served_reads = 0  # key blocks read from a unit another request wrote

    # ---- tables ---------------------------------------------------------------------------
    def _drop(self, rid: str) -> None:
        rows = self.rows.pop(rid, None)
        if rows is None:
            return
        for g, lanes in enumerate(rows):
            for j, ids in enumerate(lanes):
                for k, u in enumerate(ids):
                    if u >= 0:
                        self.maps[u].discard((rid, g, j, k))

    def _apply(self, step: int, rid: str, delta: Any) -> None:
        if delta.reset or rid not in self.rows:
            if not delta.reset:
                if rid in self.done:  # finished here; the engine learns it a few steps later
                    return
                raise SimError(f"step {step}: first delta of {rid} is no reset")
            self._drop(rid)
            self.rows[rid] = [[[] for _ in lanes] for lanes in self.windows]
        rows = self.rows[rid]
        for g, j, k, u in delta.changes:
            row = rows[g][j]
            while len(row) <= k:
                row.append(-1)
            old = row[k]
            if old >= 0:
                self.maps[old].discard((rid, g, j, k))
            row[k] = u
            if u >= 0:
                self.maps[u].add((rid, g, j, k))
        for lanes in rows:
            for row in lanes:
                del row[delta.num_blocks :]

    # ---- one batch --------------------------------------------------------------------------
    def run(self, step: int, batch: Any) -> tuple[list[str], list[str], list[str]]:
        preempted, aborted = [], []
        for task in batch.requests:
            ttype = getattr(getattr(task, "task_type", None), "name", str(getattr(task, "task_type", "")))
            idx, rid = task.idx, task.request_id
            if ttype in ("PREEMPTED", "ABORT"):
                self.slots.pop(idx, None)
                self._drop(rid)
                (preempted if ttype == "PREEMPTED" else aborted).append(rid)
                continue
            delta = getattr(task, TASK_ATTR, None)
            if delta is None:
                raise SimError(f"step {step}: {ttype} task of {rid} carries no {TASK_ATTR}")
            self._apply(step, rid, delta)
            if ttype == "PREFILL":
                slot = self.slots.get(idx)
                if slot is None or slot.rid != rid or task.prefill_start_index == 0 or rid not in self.tokens:
                    toks = list(task.prompt_token_ids) + list(task.output_token_ids)
                    done = len(task.output_token_ids)
                    slot = Slot(
                        rid, int(task.prompt_token_ids_len), int(task.sampling_params.max_tokens) - done
                    )
                    self.slots[idx] = slot
                    self.tokens[rid] = toks
                    self.hashes[rid] = chain(toks)
                slot.chunk = (int(task.prefill_start_index), int(task.prefill_end_index))
                slot.need = int(task.need_prefill_tokens)
                slot.length = slot.chunk[0]
                slot.blocks = len(task.block_tables)
            else:
                slot = self.slots.get(idx)
                if slot is not None and slot.rid == rid:
                    slot.blocks = len(task.block_tables)
        # the batch's queries: (slot, start, end)
        work = []
        for slot in self.slots.values():
            if slot.chunk is not None:
                s, e = slot.chunk
                slot.chunk = None
                if e > slot.blocks * self.bs:
                    raise SimError(
                        f"step {step}: {slot.rid} prefill [{s}, {e}) beyond its {slot.blocks} blocks"
                    )
                work.append((slot, s, e))
            elif slot.decoding and slot.produced < slot.max_tokens:
                p = slot.length
                if p < slot.blocks * self.bs:
                    work.append((slot, p, p + 1))
        if self.check:
            for slot, s, e in work:
                self._write(step, slot.rid, s, e)
            for slot, s, e in work:
                self._read(step, slot.rid, s, e)
        produced = []
        for slot, _s, e in work:
            slot.length = e
            if slot.decoding or e >= slot.need:
                slot.decoding = True
                slot.produced += 1
                toks = self.tokens[slot.rid]
                toks.append(out_token(slot.rid, len(toks) - slot.prompt_len))
                h = self.hashes[slot.rid]
                h.append(hash((h[-1], toks[-1])))
                produced.append(slot.rid)
        for idx, slot in list(self.slots.items()):
            if slot.decoding and slot.produced >= slot.max_tokens:
                del self.slots[idx]
                self._drop(slot.rid)
                self.done.add(slot.rid)
        return preempted, aborted, produced

    def _write(self, step: int, rid: str, s: int, e: int) -> None:
        bs, h, rows = self.bs, self.hashes[rid], self.rows.get(rid)
        if rows is None:
            raise SimError(f"step {step}: {rid} writes [{s}, {e}) with no tables")
        for g, lanes in enumerate(rows):
            for j, ids in enumerate(lanes):
                for p in range(s, e):
                    k, slot = divmod(p, bs)
                    u = ids[k] if k < len(ids) else -1
                    if u < 0:
                        raise SimError(
                            f"step {step}: {rid} writes position {p} (group {g} lane {j}) unmapped"
                        )
                    for rid2, g2, j2, k2 in self.maps[u]:
                        if rid2 == rid and (g2, j2, k2) == (g, j, k):
                            continue
                        h2 = self.hashes.get(rid2)
                        q = k2 * bs + slot
                        if h2 is None or q >= len(h2) or h2[q] != h[p]:
                            raise SimError(
                                f"step {step}: {rid} writes unit {u} slot {slot} (position {p}) which "
                                f"{rid2} (group {g2} lane {j2} block {k2}) may still read"
                            )
                    c = self.content.get(u)
                    if c is None:
                        c = self.content[u] = [None] * bs
                    c[slot] = h[p]

    def _read(self, step: int, rid: str, s: int, e: int) -> None:
        bs, h, rows = self.bs, self.hashes[rid], self.rows[rid]
        for g, lanes in enumerate(rows):
            for j, ids in enumerate(lanes):
                w = self.windows[g][j]
                lo = 0 if w is None else max(0, s - w)
                for k in range(lo // bs, (e - 1) // bs + 1):
                    a, b = max(lo, k * bs), min(e, (k + 1) * bs)
                    u = ids[k] if k < len(ids) else -1
                    if u < 0:
                        raise SimError(
                            f"step {step}: {rid} group {g} lane {j} block {k} unmapped for queries "
                            f"[{s}, {e}), window {w}"
                        )
                    c = self.content.get(u)
                    if c is None or c[a - k * bs : b - k * bs] != h[a:b]:
                        raise SimError(
                            f"step {step}: {rid} group {g} lane {j} block {k} (unit {u}) does not hold keys "
                            f"[{a}, {b}) of its context for queries [{s}, {e})"
                        )
                    self.keys_checked += b - a
        self.queries += e - s


class PrefixSim:
    """The engine loop around FastDeploy's real ``ResourceManagerV1`` (``_scheduler_sim.Sim``'s
    order: schedule, pickle the batch, the worker runs it ``lag`` steps later, tokens come back)."""

    def __init__(self, rm: Any, lag: int, check: bool = True) -> None:
        self.rm = rm
        self.lag = lag
        self.check = check
        self.rec = recycler_of(rm)
        self.bs = int(rm.config.cache_config.block_size)
        windows = [list(g.lanes) for g in self.rec.layout.groups] if self.rec else []
        self.worker = CheckingWorker(self.bs, windows, check and self.rec is not None)
        self.queue: deque[tuple[int, bytes]] = deque()
        self.snapshots: deque[tuple[int, dict[str, Any]]] = deque()
        self.steps = self.engine_checks = self.finished = self.aborted = self.preempted = 0
        self.peak_running = 0
        self.peak_cached = 0
        self.prompt_tokens = 0

    def check_engine(self, step: int) -> None:
        rec = self.rec
        mgr, pre = rec.manager, rec.prefix
        held: set[int] = set()
        for rid in mgr.requests:
            for lanes in mgr.lane_ids(rid):
                for ids in lanes:
                    held.update(u for u in ids if u >= 0)
        cached: set[int] = set()
        if pre is not None:
            for e in pre.entries.values():
                if e.units is not None:
                    for lanes in e.units:
                        cached.update(u for u in lanes if u >= 0)
        pool = mgr._distinct[0]
        free = set(pool.free) | set(range(pool.fresh, pool.num_units))
        if len(free) != len(pool.free) + pool.num_units - pool.fresh:
            raise SimError(f"step {step}: a unit is twice in the free list")
        if (held | cached) & free:
            raise SimError(
                f"step {step}: units {sorted((held | cached) & free)[:5]} are held or cached and free"
            )
        if len(held | cached) + len(free) != mgr.total_units:
            raise SimError(
                f"step {step}: held {len(held)} + cached {len(cached - held)} + free {len(free)} "
                f"!= pool {mgr.total_units}"
            )
        self.peak_cached = max(self.peak_cached, len(cached - held))
        self.engine_checks += 1

    def all_free_or_cached(self) -> bool:
        mgr, pre = self.rec.manager, self.rec.prefix
        cached = pre.cached_units() if pre is not None else 0
        return not mgr.requests and mgr.free_units + cached == mgr.total_units

    def run(self, trace: Trace, max_steps: int) -> PrefixSim:

        rm = self.rm
        pending = deque(trace.arrivals)
        step = 0
        while step < max_steps:
            while pending and pending[0][0] <= step:
                _, rid, prompt, mtok = pending.popleft()
                req = build_request(rid, prompt, mtok)
                rm.add_request(req)
                self.prompt_tokens += len(prompt)
                for future in list(getattr(req, "async_process_futures", None) or ()):
                    future.result()
            for rid in trace.aborts.get(step, ()):
                if rid in rm.requests:
                    rm.add_abort_req_ids([rid])
            batch, errors = rm.schedule()
            if errors:
                raise SimError(f"step {step}: schedule errors {errors}")
            self.peak_running = max(self.peak_running, len(rm.running))
            self.queue.append((step, pickle.dumps(batch)))
            if self.check and self.rec is not None:
                self.check_engine(step)
                mgr = self.rec.manager
                self.snapshots.append((step, {rid: mgr.lane_ids(rid) for rid in mgr.requests}))
            while len(self.queue) > self.lag:
                self._worker()
            step += 1
            if not pending and not rm.requests:
                break
        while self.queue:
            self._worker()
        self.steps = step
        return self

    def _worker(self) -> None:
        from fastdeploy.engine.request import RequestStatus

        rm = self.rm
        wstep, blob = self.queue.popleft()
        preempted, aborted, produced = self.worker.run(wstep, pickle.loads(blob))
        if self.snapshots:  # the worker's tables (from deltas only) are the manager's at that step
            sstep, snap = self.snapshots.popleft()
            live = {s.rid for s in self.worker.slots.values()}
            for rid, rows in self.worker.rows.items():
                if rid in snap and rid in live and rows != snap[rid]:
                    raise SimError(
                        f"step {wstep}: worker tables of {rid} differ from the manager's: "
                        f"{rows} vs {snap[rid]}"
                    )
        for rid in preempted:
            self.preempted += 1
            rm.reschedule_preempt_task(rid)
        for rid in aborted:
            self.aborted += 1
            rm.recycle_abort_task(rid)
        finished = []
        running = {r.request_id for r in rm.running}
        for rid in produced:
            req = rm.requests.get(rid)
            if req is None or rid not in running:
                continue
            req.output_token_ids.append(out_token(rid, len(req.output_token_ids)))
            if req.status == RequestStatus.RUNNING_PREFILL:
                req.status = RequestStatus.RUNNING_DECODE
            if len(req.output_token_ids) >= req.sampling_params.max_tokens:
                finished.append(rid)
        if finished:
            rm.finish_requests(finished)
            self.finished += len(finished)
