"""Multi-turn chat traces through FastDeploy's real ``ResourceManagerV1`` with prefix caching.

Imported by ``test_prefix_hit_rate.py`` (child processes with the host on ``sys.path``) and by
``benchmarks/serving_sim.py`` (the ``shared-prefix`` workload). Built on ``_scheduler_sim``: the
engine loop (:class:`ChatSim`, a :class:`~_scheduler_sim.Sim`) and its simulated worker are the
same; what differs is where the requests come from:

* a **shared system prompt** (``system`` tokens, the same ids in every conversation);
* **conversations** that re-send their history: turn ``k + 1``'s prompt is turn ``k``'s prompt,
  then the tokens turn ``k`` generated (what the engine appended to ``output_token_ids``), then a
  new user message. Turn ``k + 1`` arrives ``think`` steps (or seconds, when the loop runs a clock)
  after turn ``k`` finished, so the history it re-sends is the real one.

Every token id is drawn from a seeded generator (a conversation's ids never repeat another's by
construction: each conversation draws from its own range), so FastDeploy's chained block hashes
match exactly the shared system prompt and a conversation's own history, nothing else.

What is counted is FastDeploy's own: per request, ``request.metrics.gpu_cache_token_num`` as
FastDeploy's ``get_prefix_cached_blocks`` left it at the admission that admitted the request (the
tokens served from cache after its full-match revert; preempted re-admissions do not touch it,
c1b7c083d RM1 1460), summed over the requests (``ChatStats.served``); and the
``prefix_cache_token_num`` / ``prefix_gpu_cache_token_num`` counters (``main_process_metrics``,
RM1 1469). The counters are bumped at every admission *attempt*: a request whose blocks do not fit
is matched, freed (RM1 1137) and matched again at the next ``schedule()``, and counted again, so
under memory pressure they exceed what was served (``served_metric >= served``). Nothing of the
plugin is read to count hits.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from _prefix_sim import build_request as make_chat_request
from _scheduler_sim import Sim


@dataclass(frozen=True)
class Turn:
    user: tuple[int, ...]  # the new user message's token ids
    max_tokens: int


@dataclass(frozen=True)
class ChatTrace:
    """``system``: the shared system prompt; ``convs[c]``: conversation ``c``'s turns; ``start[c]``:
    when its first turn arrives (steps, or seconds with a clock); ``think``: the pause between a
    turn's last token and the next turn."""

    system: tuple[int, ...]
    convs: tuple[tuple[Turn, ...], ...]
    start: tuple[float, ...]
    think: float

    @property
    def requests(self) -> int:
        return sum(len(c) for c in self.convs)

    def describe(self) -> dict[str, Any]:
        users = [len(t.user) for c in self.convs for t in c]
        outs = [t.max_tokens for c in self.convs for t in c]
        return {
            "system": len(self.system),
            "conversations": len(self.convs),
            "turns": [min(len(c) for c in self.convs), max(len(c) for c in self.convs)],
            "requests": self.requests,
            "user_tokens": [min(users), max(users)],
            "output_tokens": [min(outs), max(outs)],
            "think": self.think,
        }


def make_chat_trace(
    seed: int,
    conversations: int,
    turns: tuple[int, int],
    system: int,
    user: tuple[int, int],
    output: tuple[int, int],
    every: float,
    think: float,
    max_context: int | None = None,
    vocab: int | None = None,
) -> ChatTrace:
    """``conversations`` chats, each of ``turns`` (uniform) turns with user messages of ``user`` and
    replies of ``output`` tokens (uniform), arriving ``every`` apart; a chat stops before a turn
    whose prompt plus reply would pass ``max_context``. ``vocab``: every id drawn from ``[3, vocab)``
    (a real model's vocabulary; conversations may then share ids by chance), else each
    conversation draws from its own range."""
    rng = random.Random(seed)
    sys_ids = tuple(
        rng.randrange(1000, 2000) if vocab is None else rng.randrange(3, vocab) for _ in range(system)
    )
    convs, start = [], []
    for c in range(conversations):
        lo = 10_000 + c * 10_000  # this conversation's own id range: no cross-conversation match
        if vocab is not None:
            lo = 3
        n = rng.randint(*turns)
        length = system
        chat = []
        for _ in range(n):
            u = rng.randint(*user)
            o = rng.randint(*output)
            if max_context is not None and length + u + o > max_context and chat:
                break
            hi = lo + 10_000 if vocab is None else vocab
            chat.append(Turn(tuple(rng.randrange(lo, hi) for _ in range(u)), o))
            length += u + o
        convs.append(tuple(chat))
        start.append(c * every)
    return ChatTrace(sys_ids, tuple(convs), tuple(start), think)


@dataclass
class ChatStats:
    """FastDeploy's own figures of a run (module docstring)."""

    prompt_tokens: int = 0
    served: int = 0  # sum of request.metrics.gpu_cache_token_num (the admitting admission)
    hit_requests: int = 0  # requests served at least one token from cache
    served_metric: int = 0  # prefix_cache_token_num's increase over the run (every attempt)
    served_gpu_metric: int = 0  # prefix_gpu_cache_token_num's increase over the run (every attempt)
    per_turn: list[tuple[int, int, int, int]] = field(default_factory=list)  # (conv, turn, prompt, served)


def _counter(name: str) -> float:
    """The value of FastDeploy's ``main_process_metrics.<name>`` Counter."""
    from fastdeploy.metrics.metrics import main_process_metrics

    counter = getattr(main_process_metrics, name)
    return float(counter._value.get())


class ChatSim(Sim):
    """:class:`_scheduler_sim.Sim` fed by a :class:`ChatTrace` (module docstring). With FastDeploy's
    ``enable_output_caching`` on, a request's output blocks are cached when it ends, before
    ``finish_requests``, as FastDeploy's token processor does (``cache_output_tokens``, c1b7c083d
    ``token_processor.py`` 1063): the simulated engine's ``finish_requests`` is wrapped for that."""

    def __init__(self, rm: Any, lag: int, check: bool = True, step_time: Any = None) -> None:
        super().__init__(rm, lag, check, step_time)
        cache = rm.config.cache_config
        if cache.enable_prefix_caching and getattr(cache, "enable_output_caching", False):
            finish = rm.finish_requests

            def finish_requests(request_ids: Any) -> Any:
                for rid in [request_ids] if isinstance(request_ids, str) else list(request_ids):
                    req = rm.requests.get(rid)
                    if req is not None and req in rm.running:
                        rm.cache_output_tokens(req)
                return finish(request_ids)

            rm.finish_requests = finish_requests

    def run_chat(self, trace: ChatTrace, max_steps: int) -> tuple[Any, ChatStats]:
        rm = self.rm
        chat = ChatStats()
        served0 = _counter("prefix_cache_token_num")
        gpu0 = _counter("prefix_gpu_cache_token_num")
        clocked = self.step_time is not None
        # per conversation: history so far, next turn index, when it may arrive, the live request
        history = [list(trace.system) for _ in trace.convs]
        nxt = [0] * len(trace.convs)
        ready = list(trace.start)
        live: dict[int, Any] = {}
        prompts: dict[str, list[int]] = {}
        step = 0
        while step < max_steps:
            now = self.clock if clocked else step
            for c, turns in enumerate(trace.convs):
                if c in live or nxt[c] >= len(turns) or ready[c] > now:
                    continue
                turn = turns[nxt[c]]
                rid = f"c{c}-t{nxt[c]}"
                prompt = history[c] + list(turn.user)
                prompts[rid] = prompt
                self.arrived_at[rid] = step
                self.arrival_clock[rid] = self.clock
                req = make_chat_request(rid, prompt, turn.max_tokens)
                rm.add_request(req)
                for future in list(getattr(req, "async_process_futures", None) or ()):
                    future.result()
                live[c] = req
                chat.prompt_tokens += len(prompt)
            self.step(step, _NO_ABORTS)
            step += 1
            for c, req in list(live.items()):
                if len(req.output_token_ids) >= req.sampling_params.max_tokens:  # finished
                    del live[c]
                    served = int(getattr(req.metrics, "gpu_cache_token_num", 0) or 0)
                    chat.served += served
                    chat.hit_requests += int(served > 0)
                    chat.per_turn.append((c, nxt[c], len(prompts[req.request_id]), served))
                    history[c] = prompts[req.request_id] + list(req.output_token_ids)
                    nxt[c] += 1
                    ready[c] = (self.clock if clocked else step) + trace.think
            if not live and all(nxt[c] >= len(t) for c, t in enumerate(trace.convs)) and not rm.requests:
                break
            if not live and not rm.requests and not self.queue and clocked:
                # idle until the next arrival: the clock jumps there (no forward runs)
                pending = [ready[c] for c, t in enumerate(trace.convs) if nxt[c] < len(t)]
                if pending:
                    self.clock = max(self.clock, min(pending))
        while self.queue:
            self.run_worker()
        self.stats.steps = step
        chat.served_metric = round(_counter("prefix_cache_token_num") - served0)
        chat.served_gpu_metric = round(_counter("prefix_gpu_cache_token_num") - gpu0)
        return self.stats, chat


class _NoAborts:
    aborts: dict[int, list[str]] = {}


_NO_ABORTS = _NoAborts()

__all__ = ["ChatSim", "ChatStats", "ChatTrace", "Turn", "make_chat_request", "make_chat_trace"]
