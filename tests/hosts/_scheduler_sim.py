"""FastDeploy's real ``ResourceManagerV1`` driven by seeded request traces, with a simulated worker.

Imported by the scenarios of ``test_kv_recycling_scheduler.py`` (child processes with the host on
``sys.path``) and by ``benchmarks/serving_sim.py``. Nothing here replaces FastDeploy's scheduler:
:func:`make_manager` builds FastDeploy's own config (``EngineArgs.create_engine_config``) and
``ResourceManagerV1``; the plugin's hook is whatever the plugin's own early hook installed.

The engine loop (:class:`Sim`) per step: ``rm.schedule()``, the batch is pickled (what FastDeploy
sends to the worker) and queued; the worker runs the batch scheduled ``lag`` steps earlier; the
tokens it produced reach the engine (output ids appended, ``finish_requests`` at ``max_tokens``,
``reschedule_preempt_task`` / ``recycle_abort_task`` once the worker has seen those tasks).

:class:`SimWorker` does what FastDeploy's worker does with the tasks: a prefill task runs its
chunk ``[prefill_start_index, prefill_end_index)`` and emits a token after the last chunk, a
decoding slot emits one token per step while its next position has a block
(``len(block_tables) * block_size``), a preempt / abort task clears the slot. With the hook it
applies each task's ``KVDelta`` (``protocol.LaneTables``) and, before running a batch, checks
every query of the batch: each key block inside its window (full lanes: the whole prefix) is
mapped in its own rows and held by no other live request of the same group.
"""

from __future__ import annotations

import os
import pickle
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from fastdeploy_paddlefleet.serving.kv_recycling.protocol import TASK_ATTR, LaneTables
from fastdeploy_paddlefleet.serving.kv_recycling.scheduler import recycler_of


class SimError(AssertionError):
    """An invariant broke (message names step, request and what)."""


def make_config(
    model_dir: str,
    *,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    block_size: int,
    num_blocks: int,
    quantization: dict[str, Any] | None = None,
) -> Any:
    """FastDeploy's own ``FDConfig`` for ``--model-impl paddlefleet`` with ``num_blocks`` blocks;
    ``quantization``: FastDeploy's ``--quantization`` (e.g. ``mix_quant`` with a ``kv_cache_quant_type``)."""
    import fastdeploy.envs as fd_envs
    from fastdeploy.engine.args_utils import EngineArgs

    cfg = EngineArgs(
        model=model_dir,
        model_impl="paddlefleet",
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        enable_chunked_prefill=True,
        **({} if quantization is None else {"quantization": dict(quantization)}),
    ).create_engine_config()
    # FastDeploy turns V1 scheduling off on platforms it does not serve on (CPU here); the
    # scheduler under test is V1's, so it is turned back on for these scenarios
    fd_envs.ENABLE_V1_KVCACHE_SCHEDULER = 1
    # what EngineArgs left before profiling (FastDeploy's placeholder), and the count "profiled"
    cfg._fdfleet_sim_placeholder = cfg.cache_config.total_block_num
    cfg._fdfleet_sim_blocks = num_blocks
    cfg.parallel_config.local_engine_worker_queue_port = 20000 + (os.getpid() * 7 + num_blocks) % 30000
    return cfg


def make_manager(cfg: Any, model_dir: str | None = None, *, fastdeploy_check: bool = False) -> Any:
    """FastDeploy's ``ResourceManagerV1`` for ``cfg`` (``model_dir``: the plan's config.json), started in
    FastDeploy's own order (``EngineService``): built on the placeholder block count ``EngineArgs``
    left, then ``reset_cache_config`` with the count of ``make_config(num_blocks=...)``, as after
    profiling. ``fastdeploy_check``: through ``CacheConfig.reset`` with its assertion (a count below
    ``max_model_len // block_size + 2`` is refused by FastDeploy itself); else the count is set as
    ``reset`` sets it without that check, so small pools force preemption."""
    from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1

    if model_dir is not None:
        cfg.model_config.model = model_dir
    cfg.parallel_config.local_engine_worker_queue_port += 1
    cc = cfg.cache_config
    cc.total_block_num = cc.prefill_kvcache_block_num = cfg._fdfleet_sim_placeholder
    rm = ResourceManagerV1(cfg.scheduler_config.max_num_seqs, cfg, 1, "mixed", 0)
    if fastdeploy_check:
        cc.reset(cfg._fdfleet_sim_blocks)
    else:
        cc.total_block_num = cc.prefill_kvcache_block_num = cfg._fdfleet_sim_blocks
    rm.reset_cache_config(cc)
    return rm


def make_request(rid: str, prompt_len: int, max_tokens: int) -> Any:
    from fastdeploy.engine.request import Request
    from fastdeploy.engine.sampling_params import SamplingParams

    req = Request(
        request_id=rid,
        prompt_token_ids=[1] * prompt_len,
        prompt_token_ids_len=prompt_len,
        sampling_params=SamplingParams(max_tokens=max_tokens),
        eos_token_ids=[0],
    )
    return req


@dataclass
class Slot:
    rid: str
    max_tokens: int
    length: int = 0  # tokens whose K/V the worker has written
    blocks: int = 0  # len(block_tables) of the latest task
    chunk: tuple[int, int] | None = None
    decoding: bool = False
    produced: int = 0
    need: int = 0


@dataclass
class Stats:
    steps: int = 0
    tokens: int = 0
    prefill_tokens: int = 0
    finished: int = 0
    preempted: int = 0
    aborted: int = 0
    deltas: int = 0
    released_entries: int = 0
    peak_running: int = 0
    peak_decoding: int = 0
    checks: int = 0
    ttft: list[int] = field(default_factory=list)
    step_batches: list[tuple[int, int, int]] = field(
        default_factory=list
    )  # (decode tokens, prefill tokens, ctx sum)


class SimWorker:
    """The worker side: slots, tables from deltas, window checks (see the module docstring)."""

    def __init__(self, block_size: int, layout: Any | None, check: bool = True) -> None:
        self.bs = block_size
        self.layout = layout
        self.tables = LaneTables(layout) if layout is not None else None
        self.slots: dict[int, Slot] = {}
        self.check = check
        self.windows = [list(g.lanes) for g in layout.groups] if layout is not None else []
        self.released = 0  # table entries the deltas released
        self.emptied = 0  # tasks whose request was preempted later in the same batch (reset to nothing)
        self._checks = 0  # queries whose windows were checked
        self.decode_ctx: list[int] = []
        self.chunks: list[tuple[int, int]] = []

    def run(self, step: int, batch: Any) -> tuple[list[str], list[str], list[tuple[str, int]], int]:
        """Apply ``batch`` then run one forward. Returns (preempted ids seen, aborted ids seen,
        tokens produced as (rid, 1), prefill tokens run)."""
        preempted, aborted = [], []
        for task in batch.requests:
            ttype = getattr(getattr(task, "task_type", None), "name", str(getattr(task, "task_type", "")))
            idx, rid = task.idx, task.request_id
            if ttype in ("PREEMPTED", "ABORT"):
                self.slots.pop(idx, None)
                if self.tables is not None:
                    self.tables.drop(rid)
                (preempted if ttype == "PREEMPTED" else aborted).append(rid)
                continue
            delta = getattr(task, TASK_ATTR, None)
            if self.tables is not None:
                if delta is None:  # the plugin's runner refuses such a task (no tables to run it with)
                    raise SimError(f"step {step}: {ttype} task of {rid} carries no {TASK_ATTR}")
                if self.tables.apply(delta):
                    self.released += sum(1 for c in delta.changes if c[3] < 0)
                    if delta.reset and delta.num_blocks == 0:  # freed later in the same schedule()
                        self.emptied += 1
            if ttype == "PREFILL":
                slot = self.slots.get(idx)
                if slot is None or slot.rid != rid or task.prefill_start_index == 0:
                    # a recomputed request (after preemption) prefills its earlier outputs too
                    done = int(task.need_prefill_tokens) - int(task.prompt_token_ids_len)
                    slot = Slot(rid, int(task.sampling_params.max_tokens) - done)
                    self.slots[idx] = slot
                slot.chunk = (int(task.prefill_start_index), int(task.prefill_end_index))
                slot.need = int(task.need_prefill_tokens)
                slot.blocks = len(task.block_tables)
            else:  # decode task: more blocks (and maybe released ones)
                slot = self.slots.get(idx)
                if slot is not None and slot.rid == rid:
                    slot.blocks = len(task.block_tables)
        if self.check and self.tables is not None:
            self._check_tables(step)
        produced, prefill_tokens = [], 0
        self.decode_ctx, self.chunks = [], []  # this forward's shape, for step-time models
        for slot in list(self.slots.values()):
            if slot.chunk is not None:
                s, e = slot.chunk
                slot.chunk = None
                if e > slot.blocks * self.bs:
                    raise SimError(
                        f"step {step}: {slot.rid} prefill [{s}, {e}) beyond its {slot.blocks} blocks"
                    )
                self._check_queries(step, slot.rid, s, e)
                slot.length = e
                prefill_tokens += e - s
                self.chunks.append((s, e - s))
                if e >= slot.need:
                    slot.decoding = True
                    slot.produced += 1
                    produced.append((slot.rid, 1))
            elif slot.decoding and slot.produced < slot.max_tokens:
                p = slot.length
                if p < slot.blocks * self.bs:  # else: out of blocks, waits for the engine
                    self._check_queries(step, slot.rid, p, p + 1)
                    self.decode_ctx.append(p + 1)
                    slot.length = p + 1
                    slot.produced += 1
                    produced.append((slot.rid, 1))
        for idx, slot in list(self.slots.items()):
            if slot.decoding and slot.produced >= slot.max_tokens:  # the worker stops it itself
                del self.slots[idx]
                if self.tables is not None:
                    self.tables.drop(slot.rid)
        return preempted, aborted, produced, prefill_tokens

    def _check_tables(self, step: int) -> None:
        """No page of the one pool held twice among the live requests' rows (any group, any lane)."""
        live = {s.rid for s in self.slots.values()}
        owner: dict[int, tuple] = {}
        for rid in live:
            rows = self.tables.rows.get(rid)
            if rows is None:
                continue
            for g, lanes in enumerate(rows):
                for lane, ids in enumerate(lanes):
                    for u in ids:
                        if u < 0:
                            continue
                        if owner.setdefault(u, (rid, g, lane)) != (rid, g, lane):
                            raise SimError(
                                f"step {step}: page {u} in the rows of {owner[u]} and {(rid, g, lane)}"
                            )

    def _check_queries(self, step: int, rid: str, start: int, end: int) -> None:
        """Queries at positions [start, end) of ``rid``: every key block they see is mapped."""
        if self.tables is None or not self.check:
            return
        rows = self.tables.rows.get(rid)
        if rows is None:
            raise SimError(f"step {step}: {rid} runs positions [{start}, {end}) with no tables")
        bs = self.bs
        for g, lanes in enumerate(rows):
            for lane, ids in enumerate(lanes):
                w = self.windows[g][lane]
                lo = 0 if w is None else max(0, start - w)
                for k in range(lo // bs, (end - 1) // bs + 1):
                    if k >= len(ids) or ids[k] < 0:
                        raise SimError(
                            f"step {step}: {rid} group {g} lane {lane} block {k} (keys "
                            f"[{k * bs}, {(k + 1) * bs})) is not mapped for queries [{start}, {end}), "
                            f"window_left {w}"
                        )
        self._checks += 1


@dataclass
class Trace:
    """Seeded arrivals: ``(step, rid, prompt_len, max_tokens)``, plus abort requests."""

    arrivals: list[tuple[int, str, int, int]]
    aborts: dict[int, list[str]]


def make_trace(
    seed: int,
    n: int,
    prompt: tuple[int, int],
    out: tuple[int, int],
    every: int,
    aborts: float = 0.0,
    long: tuple[tuple[int, int], float] | None = None,
) -> Trace:
    """``n`` requests, one every ``every`` steps (jittered), prompts and outputs uniform in the given
    ranges; ``long = ((lo, hi), p)``: each prompt is drawn from ``(lo, hi)`` instead with probability
    ``p`` (short and long requests mixed); ``aborts``: the share aborted while decoding."""
    rng = random.Random(seed)
    arrivals, abort_at = [], {}
    for i in range(n):
        step = i * every + rng.randint(0, max(0, every - 1))
        rid = f"r{seed}-{i}"
        span = long[0] if long is not None and rng.random() < long[1] else prompt
        arrivals.append((step, rid, rng.randint(*span), rng.randint(*out)))
        if rng.random() < aborts:
            abort_at.setdefault(step + rng.randint(5, 60), []).append(rid)
    return Trace(arrivals, abort_at)


class Sim:
    """The engine loop around FastDeploy's real ``ResourceManagerV1`` (module docstring)."""

    def __init__(self, rm: Any, lag: int, check: bool = True, step_time: Any = None) -> None:
        """``step_time(decode_ctx, chunks) -> seconds`` (optional) prices each worker forward:
        ``self.clock`` then runs in seconds, and TTFT (``stats.ttft``) is in seconds too."""
        self.step_time = step_time
        self.clock = 0.0
        self.arrival_clock: dict[str, float] = {}
        self.rm = rm
        self.lag = lag
        self.rec = recycler_of(rm)
        self.bs = int(rm.config.cache_config.block_size)
        self.worker = SimWorker(self.bs, self.rec.layout if self.rec else None, check)
        self.check = check
        self.queue: deque[tuple[int, bytes]] = deque()
        self.snapshots: deque[tuple[int, dict[str, Any]]] = deque()
        self.stats = Stats()
        self.preempted_ids: set[str] = set()  # requests preempted at least once
        self.arrived_at: dict[str, int] = {}

    # ---- engine-side invariants -------------------------------------------------------------
    def check_engine(self, step: int) -> None:
        rec = self.rec
        if rec is None:
            return
        mgr = rec.manager
        seen: dict[int, tuple] = {}
        held = 0
        for rid in mgr.requests:
            for g, lanes in enumerate(mgr.lane_ids(rid)):
                for lane, ids in enumerate(lanes):
                    for u in ids:
                        if u < 0:
                            continue
                        held += 1
                        if seen.setdefault(u, (rid, g, lane)) != (rid, g, lane):
                            raise SimError(f"step {step}: page {u} owned by {seen[u]} and {(rid, g, lane)}")
        if held + mgr.free_units != mgr.total_units:
            raise SimError(f"step {step}: held {held} + free {mgr.free_units} != pool {mgr.total_units}")
        # the free count FastDeploy reads is a promise the pools keep (allocate() raises otherwise)
        free = self.rm.available_block_num()
        if not rec.can_allocate(free):
            raise SimError(f"step {step}: available_block_num()={free} but can_allocate({free}) is False")
        self.stats.checks += 1

    def step(self, step: int, trace: Trace) -> None:
        rm = self.rm
        for rid in trace.aborts.get(step, ()):
            req = rm.requests.get(rid)
            if req is not None and req in rm.running and rm._is_decoding(req):
                rm.add_abort_req_ids([rid])
        batch, errors = rm.schedule()
        if errors:
            raise SimError(f"step {step}: schedule errors {errors}")
        self.stats.peak_running = max(self.stats.peak_running, len(rm.running))
        self.stats.peak_decoding = max(
            self.stats.peak_decoding, sum(1 for r in rm.running if rm._is_decoding(r))
        )
        self.queue.append((step, pickle.dumps(batch)))
        if self.rec is not None and self.check:
            self.check_engine(step)
            self.snapshots.append(
                (step, {rid: self.rec.manager.lane_ids(rid) for rid in self.rec.manager.requests})
            )
        while len(self.queue) > self.lag:
            self.run_worker()

    def run_worker(self) -> None:
        wstep, blob = self.queue.popleft()
        batch = pickle.loads(blob)
        preempted, aborted, produced, prefill_tokens = self.worker.run(wstep, batch)
        if self.step_time is not None:
            self.clock += self.step_time(self.worker.decode_ctx, self.worker.chunks)
        if self.rec is not None and self.check:
            sstep, snap = self.snapshots.popleft()
            assert sstep == wstep
            for rid, rows in self.worker.tables.rows.items():
                if rid in snap and any(s.rid == rid for s in self.worker.slots.values()):
                    if rows != snap[rid]:
                        raise SimError(f"step {wstep}: worker tables of {rid} differ from the manager's")
        from fastdeploy.engine.request import RequestStatus

        rm = self.rm
        for rid in preempted:
            self.stats.preempted += 1
            self.preempted_ids.add(rid)
            rm.reschedule_preempt_task(rid)
        for rid in aborted:
            self.stats.aborted += 1
            rm.recycle_abort_task(rid)
        finished = []
        running = {r.request_id for r in rm.running} if produced else set()
        for rid, _ in produced:
            req = rm.requests.get(rid)
            if req is None or rid not in running:
                continue  # preempted / aborted meanwhile: FastDeploy drops these too
            if not req.output_token_ids:
                if self.step_time is not None:
                    self.stats.ttft.append(self.clock - self.arrival_clock.get(rid, self.clock))
                else:
                    self.stats.ttft.append(wstep - self.arrived_at.get(rid, wstep))
            req.output_token_ids.append(7)
            if req.status == RequestStatus.RUNNING_PREFILL:  # what FastDeploy's token processor does
                req.status = RequestStatus.RUNNING_DECODE
            self.stats.tokens += 1
            if len(req.output_token_ids) >= req.sampling_params.max_tokens:
                finished.append(rid)
        if finished:
            rm.finish_requests(finished)
            self.stats.finished += len(finished)
        self.stats.prefill_tokens += prefill_tokens

    def run(self, trace: Trace, max_steps: int) -> Stats:
        pending = deque(sorted(trace.arrivals))
        step = 0
        while step < max_steps:
            while pending and pending[0][0] <= step:
                _, rid, plen, mtok = pending.popleft()
                self.arrived_at[rid] = step
                self.arrival_clock[rid] = self.clock
                req = make_request(rid, plen, mtok)
                self.rm.add_request(req)
                # FastDeploy preprocesses each request on a thread pool and skips it while that runs:
                # waited for here, so a trace schedules the same way every run (and in both modes)
                for future in list(getattr(req, "async_process_futures", None) or ()):
                    future.result()
            self.step(step, trace)
            step += 1
            if not pending and not self.rm.requests:
                break
        while self.queue:
            self.run_worker()
        self.stats.steps = step
        return self.stats

    def all_free(self) -> bool:
        rec = self.rec
        if rec is None:
            return True
        mgr = rec.manager
        return not mgr.requests and mgr.free_units == mgr.total_units
