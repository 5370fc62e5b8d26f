"""FastDeploy's real scheduler driving a step-time model: FastDeploy's KV accounting vs window recycling.

Both modes run FastDeploy's own ``ResourceManagerV1.schedule()`` (the host's real code, located by
``FDFLEET_HOST_FASTDEPLOY`` or an installed ``fastdeploy``) over the same requests and the same KV
bytes: ``fastdeploy`` is its one block pool (``FDFLEET_KV_RECYCLE=off``), ``recycling`` is the
plugin's hook (installed by the plugin's own early hook with ``FD_PLUGINS=paddlefleet``) routing
the block calls to the one shared pool of ``kvcache/pools.py`` with window recycling. The worker is
simulated (``tests/hosts/_scheduler_sim.py``: tasks pickled, deltas applied, one forward per step)
and each forward is priced with the step-time model of ``headwise_sim.py`` (one roofline per
phase: weights read once per step, attention bytes and FLOPs per visible key, H200 figures; see its
docstring). The attention roofline is checked against the measured H200 decode bandwidth in
``results/attention-h200.jsonl`` (the model's ``BW`` must not exceed what the kernels reached).

Workloads (:data:`WORKLOADS`), every request arriving at time 0 (saturated), FastDeploy settings
block 64, ``max_num_batched_tokens`` 8192:

* ``prefill-heavy`` (4 models, contexts 8k and 32k): prompt ``context - 1024``, 1024 generated,
  ``max_model_len`` = context + 512.
* ``decode-heavy`` (gpt-oss-20b, MiMo-like): 1024-token prompts, 7168 generated (8k context),
  ``max_model_len`` 8704.
* ``short`` (4 models; chat traffic): 256-token prompts, 256 generated, ``max_model_len`` 8192.
* ``mixed`` (4 models): 70% short requests (prompt 128-512, output 64-256) and 30% long ones
  (prompt 4096-7168, output 256-1024), uniform draws, seed 11, ``max_model_len`` 8192 (the row's
  ``context``).

* ``shared-prefix`` (gpt-oss-20b, MiMo-like; issue 32): multi-turn chats through
  ``tests/hosts/_prefix_trace.py``: a 2048-token system prompt shared by every conversation, 4 to 8
  turns per conversation, user messages 128-512 tokens, replies 128-256, each turn re-sending the
  whole history (previous prompt, the generated tokens, the new message) and arriving
  ``think_s`` simulated seconds after the previous turn's last token; ``max_model_len`` 8192 (a
  chat stops before a turn that would pass it). Three modes (:data:`PREFIX_MODES`), the same trace
  and KV bytes: ``fastdeploy-prefix`` (FastDeploy's prefix caching, its own accounting),
  ``recycling`` (window recycling; prefix caching off, what the hook did before issue 32) and
  ``recycling-prefix`` (both: prefix caching asked for with recycling on; the row's
  ``prefix_caching`` says whether the hook kept it on). Prefix caching is FastDeploy's
  ``enable_prefix_caching`` (its default ``enable_output_caching=False``). Rows add the tokens
  FastDeploy served from cache (``cached_tokens_served``: each request's
  ``metrics.gpu_cache_token_num``, summed; ``prefix_cache_token_num``: its counter, which counts
  every admission attempt) and the prefill tokens the worker ran. Conversations: twice what the
  recycling pool holds at the chats' mean final context (at least 16), all starting at time 0;
  ``max_num_seqs`` 512 only.

Requests: twice what the recycling pool holds at the workload's sizing length (``capacity(...)
.recycling_requests``, capped at ``max_num_seqs``; prefill- and decode-heavy: ``max_model_len``,
short: 512, mixed: the mix's mean final context), at least 16; that fills both modes (recycling
never holds fewer than FastDeploy). KV budget: 0.9 x an H200's memory minus bf16 weights minus 4 GB,
the same bytes for both modes: FastDeploy's ``num_gpu_blocks`` at its per-layer block bytes
(``PoolLayout.layer_elements``), the pool's at ``PoolLayout.block_bytes`` (equal for the presets:
no padding). Reported: peak concurrent running requests, output tokens/s over the run, TTFT p50 /
p99 (queueing included), preemptions, the KV pool's peak and mean usage, the mean decode batch.

``max_num_seqs`` (a FastDeploy user setting), two settings, each row saying which (``seqs``) and
the value (``max_num_seqs``, ``cap_reached`` = peak running hit it):

* ``512``: the most FastDeploy accepts (``FDConfig.check`` refuses more: c1b7c083d
  ``config.py:2306``), so what a user serving for throughput sets. In the decode-heavy and short
  workloads gpt-oss-20b reaches it in both modes: the cap, not KV memory, decides its concurrency.
* ``non-binding``: 1.25 x the most requests either mode holds at once at the workload's shortest
  prompt (``capacity(layout, num_gpu_blocks, prompt)``: ``fastdeploy_requests`` and
  ``recycling_requests``). Running requests only grow from there, so KV memory binds before the cap
  in both modes. Above 512 this is a what-if beyond what FastDeploy accepts
  (``beyond_fastdeploy_limit``): the config is built at 512 and the value set after FastDeploy's
  check, for the scheduler and the hook alike.

Model sizes (weights): gpt-oss-20b and ERNIE-4.5-21B-A3B as in ``headwise_sim.py``; Gemma-3-27B
27.4B dense; MiMo-V2-Flash-like is one GPU's share of an 8-way expert-parallel deployment (each GPU
serves its own requests with every attention head; 1/8 of the 256 experts, top-8): 5.3B dense +
38.6B of experts, 15B active per token. These are stated assumptions, not measurements. All
weights are bf16, gpt-oss-20b's too: its checkpoint ships MXFP4 experts (about 12.8 GB in all), but
the plugin refuses a checkpoint's ``quantization_config`` at load (``serving/checks.py``), so what
it serves is the bf16 model (41.8 GB). ``decode_bounds`` also prices the MXFP4 case (``mxfp4``).

NOTES: the most recycling can give (``decode_bounds``, in the JSON as ``bounds``). In a saturated
decode phase of ``B`` requests at context ``c`` one step costs ``t_w + B * t_kv``: ``t_w`` the
per-step fixed cost (overhead + weight bytes / BW; gpt-oss-20b hits every expert at these batch
sizes), ``t_kv`` one request's attention bytes / BW (its full layers read ``c`` keys, its sliding
ones ``W + 1``; both modes read the same keys: a window-aware kernel skips the rest whether or not
the pages were recycled). So tokens/s = ``B / (t_w + B * t_kv)``, and running ``r`` times as many
requests in the same memory gives at most::

    gain(r) = r * (t_w + B * t_kv) / (t_w + r * B * t_kv)   ->  1 + t_w / (B * t_kv)  as r -> inf

Recycling shrinks a request's cache, not its reads: a model whose full layers make ``B * t_kv``
comparable to ``t_w`` (gpt-oss-20b: 12 of 24 layers full, 8 kv heads) cannot turn concurrency into
throughput; one dominated by ``t_w`` (MiMo-like's experts, Gemma's dense 27B) can. ``B`` is
FastDeploy's concurrency at the decode phase's mean context ``c = prompt + output / 2``
(``capacity(...).fastdeploy_requests``: ``num_gpu_blocks // blocks(c + look-ahead)``), ``r`` the
one pool's ratio at ``c`` (``capacity(...).ratio``: requests holding what their lanes hold at ``c``,
less one step's prefill on the sliding lanes), both capped at the setting's ``max_num_seqs``. The
mixed workload has no single length and no bound. ``gain_bound`` is the formula;
``gain_bound_exact`` prices both batches with ``step_time`` itself (MiMo-like's expert reads still
grow with ``B``; gpt-oss with MXFP4 weights turns compute-bound in its linear layers).
``gain_estimate_end_to_end`` adds each prompt's prefill (the same compute in both modes) per
request, phases apart: ``(t_pf + out * T(B)/B) / (t_pf + out * T(rB)/(rB))``; an estimate, not a
bound (ramp, drain and recomputation after preemption are left out).

Run ``python benchmarks/serving_sim.py --out benchmarks/results/serving_sim.json`` (tens of minutes
on a shared 2-core machine; ``--models`` / ``--workload`` / ``--seqs`` with ``--merge`` redo only
some rows) or ``--smoke`` (seconds, tiny prefill-heavy, short and mixed workloads, written to a
temporary directory: never the committed results; ``--smoke --workload shared-prefix``: a tiny
shared-prefix run in its three modes).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for extra in (HERE, REPO / "tests" / "hosts"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from _outputs import (  # noqa: E402
    Claim,
    Refused,
    claim,
    fail,
    force_help,
    mark,
    output_path,
    plot_path,
    read_json,
    replacing,
)

SCRIPT = "serving_sim"  # the mark on what this script writes (benchmarks/_outputs.py)
HOST_VAR = "FDFLEET_HOST_FASTDEPLOY"
#: where ``.ci/run`` and README.md ("Conformance tests against the hosts' real code") keep FastDeploy
HOST_DEFAULT = "~/.cache/fdfleet-hosts/fastdeploy"
#: what a row of an earlier run's JSON needs for ``--merge`` / ``--replot``
ROW_KEYS = ("model", "context", "mode", "peak_running", "tokens_per_s")

logger = logging.getLogger("serving_sim")

MODELS_EXTRA = {
    # dense: no routed experts (headwise_sim's formula needs top_k < experts; 0 expert bytes)
    "gemma3-27b": {"total": 27.4e9, "active": 27.4e9, "experts": 2, "top_k": 1},
    "mimo-v2-flash-like": {"total": 43.9e9, "active": 15.0e9, "experts": 256, "top_k": 8},
}
PRESETS = ["gpt-oss-20b", "mimo-v2-flash-like", "gemma3-27b", "ernie-4.5-21b-a3b-headwise"]
# prefill-heavy: (context, output tokens, requests; 0 = saturated)
CONTEXTS = [(8192, 1024, 0), (32768, 1024, 0)]
# decode-heavy: 1024-token prompts, the rest of the context generated, for the two models with a
# throughput target
DECODE_HEAVY = {"presets": ["gpt-oss-20b", "mimo-v2-flash-like"], "context": 8192, "prompt": 1024}
# short: chat traffic, every model
SHORT_WORKLOAD = {"prompt": 256, "output": 256, "max_model_len": 8192}
# mixed: a seeded length mix, every model: (prompt range, output range) of each kind, share of long
MIXED = {
    "short": ((128, 512), (64, 256)),
    "long": ((4096, 7168), (256, 1024)),
    "p_long": 0.3,
    "max_model_len": 8192,
}
# shared-prefix (issue 32): multi-turn chats sharing a system prompt, three modes (module docstring)
SHARED_PREFIX = {
    "presets": ["gpt-oss-20b", "mimo-v2-flash-like"],
    "max_model_len": 8192,
    "system": 2048,
    "turns": (4, 8),
    "user": (128, 512),
    "output": (128, 256),
    "think_s": 2.0,
}
#: the shared-prefix workload's modes: (name, window recycling, prefix caching asked for)
PREFIX_MODES = (
    ("fastdeploy-prefix", False, True),
    ("recycling", True, False),
    ("recycling-prefix", True, True),
)
WORKLOADS = ("prefill-heavy", "decode-heavy", "short", "mixed", "shared-prefix")
SEED = 11
DTYPE = "bfloat16"
BLOCK, BATCHED, MAX_SEQS = 64, 8192, 512
# max_num_seqs settings (module docstring): the fixed 512, and 1.25 x what the pools hold at the prompt
SEQS = ("512", "non-binding")
SEQS_MARGIN = 1.25
# FastDeploy refuses max_num_seqs above this (c1b7c083d config.py:2306, FDConfig.check)
FD_MAX_SEQS_LIMIT = 512
# gpt-oss-20b's checkpoint: MXFP4 experts, 4 bits + one 8-bit scale per 32 values (4.25 bits)
MXFP4_BYTES = 4.25 / 8


@dataclass(frozen=True)
class Shape:
    """One workload's requests for one model: each request's prompt and output drawn uniformly from
    ``prompt`` / ``output`` (``long``: with probability ``p_long`` from its (prompt, output) ranges
    instead). ``context``: the row's context (prompt + output; mixed: ``max_model_len``);
    ``size_at``: the length the request count is sized at; ``requests``: 0 = saturated (twice what
    the recycling pool holds at ``size_at``)."""

    workload: str
    context: int
    max_model_len: int
    prompt: tuple[int, int]
    output: tuple[int, int]
    size_at: int
    requests: int = 0
    long: tuple[tuple[int, int], tuple[int, int]] | None = None
    p_long: float = 0.0
    #: shared-prefix chats (``SHARED_PREFIX``'s keys but presets): ``prompt`` / ``output`` then
    #: only describe the first turn's prompt and the replies
    chat: dict[str, Any] | None = None

    @property
    def fixed(self) -> bool:
        return (
            self.chat is None
            and self.long is None
            and self.prompt[0] == self.prompt[1]
            and self.output[0] == self.output[1]
        )

    @property
    def shortest_prompt(self) -> int:
        return min(self.prompt[0], self.long[0][0]) if self.long else self.prompt[0]

    def arrivals(self, n: int, seed: int = SEED) -> list[tuple[int, str, int, int]]:
        """``n`` requests at step 0: ``(0, rid, prompt, max_tokens)``, seeded."""
        rng = random.Random(seed)
        out = []
        for i in range(n):
            prompt, output = self.prompt, self.output
            if self.long is not None and rng.random() < self.p_long:
                prompt, output = self.long
            out.append((0, f"r{seed}-{i}", rng.randint(*prompt), rng.randint(*output)))
        return out

    def chat_trace(self, conversations: int, seed: int = SEED) -> Any:
        """The seeded chats of a shared-prefix shape (``_prefix_trace.make_chat_trace``)."""
        from _prefix_trace import make_chat_trace

        c = self.chat
        return make_chat_trace(
            seed,
            conversations,
            tuple(c["turns"]),
            c["system"],
            tuple(c["user"]),
            tuple(c["output"]),
            every=0.0,
            think=c["think_s"],
            max_context=self.max_model_len,
        )

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "workload": self.workload,
            "context": self.context,
            "max_model_len": self.max_model_len,
        }
        if self.chat is not None:
            d.update(prompt=None, output=None, chat=dict(self.chat))
        elif self.fixed:
            d.update(prompt=self.prompt[0], output=self.output[0])
        else:
            d.update(
                prompt=None, output=None, mix={"short": [self.prompt, self.output], "p_long": self.p_long}
            )
            if self.long is not None:
                d["mix"]["long"] = list(self.long)
        return d


def _mixed_shape(mix: dict[str, Any], requests: int = 0) -> Shape:
    (plo, phi), (olo, ohi) = mix["short"]
    (llo, lhi), (lolo, lohi) = mix["long"]
    p = mix["p_long"]
    mean = (1 - p) * (plo + phi + olo + ohi) / 2 + p * (llo + lhi + lolo + lohi) / 2
    return Shape(
        "mixed",
        mix["max_model_len"],
        mix["max_model_len"],
        mix["short"][0],
        mix["short"][1],
        size_at=round(mean),
        requests=requests,
        long=mix["long"],
        p_long=p,
    )


def _chat_shape(chat: dict[str, Any], requests: int = 0) -> Shape:
    """A shared-prefix shape; sized at the chats' mean final context (system prompt plus the mean
    turns of mean user message and reply, within ``max_model_len``)."""
    spec = {k: v for k, v in chat.items() if k != "presets"}
    mml = spec.pop("max_model_len")
    turn = (sum(spec["user"]) + sum(spec["output"])) / 2
    mean = min(mml, spec["system"] + sum(spec["turns"]) / 2 * turn)
    system = spec["system"]
    return Shape(
        "shared-prefix",
        mml,
        mml,
        (system + spec["user"][0], system + spec["user"][1]),
        tuple(spec["output"]),
        size_at=round(mean),
        requests=requests,
        chat=spec,
    )


def shapes(workload: str, name: str) -> list[Shape]:
    """The full run's shapes of ``workload`` for preset ``name`` (empty where it does not run)."""
    if workload == "prefill-heavy":
        return [Shape(workload, c, c + 512, (c - o, c - o), (o, o), size_at=c + 512) for c, o, _ in CONTEXTS]
    if workload == "decode-heavy":
        if name not in DECODE_HEAVY["presets"]:
            return []
        c, pr = DECODE_HEAVY["context"], DECODE_HEAVY["prompt"]
        return [Shape(workload, c, c + 512, (pr, pr), (c - pr, c - pr), size_at=c + 512)]
    if workload == "short":
        pr, o = SHORT_WORKLOAD["prompt"], SHORT_WORKLOAD["output"]
        return [Shape(workload, pr + o, SHORT_WORKLOAD["max_model_len"], (pr, pr), (o, o), size_at=pr + o)]
    if workload == "mixed":
        return [_mixed_shape(MIXED)]
    if workload == "shared-prefix":
        return [_chat_shape(SHARED_PREFIX)] if name in SHARED_PREFIX["presets"] else []
    raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")


# --smoke: a tiny run of three workloads (seconds), its own KV budget
SMOKE = {
    "presets": ["gpt-oss-20b"],
    "budget": 1 << 30,
    "shapes": [
        Shape("prefill-heavy", 2048, 2560, (1984, 1984), (64, 64), size_at=2560, requests=24),
        Shape("short", 288, 8192, (256, 256), (32, 32), size_at=288, requests=24),
        _mixed_shape(
            {
                "short": ((64, 128), (8, 16)),
                "long": ((1024, 1536), (16, 32)),
                "p_long": 0.3,
                "max_model_len": 2048,
            },
            requests=24,
        ),
    ],
    # run only when named (--smoke --workload shared-prefix): 24 tiny chats in the three modes
    "prefix_shapes": [
        _chat_shape(
            {
                "max_model_len": 2048,
                "system": 512,
                "turns": (2, 3),
                "user": (32, 128),
                "output": (16, 32),
                "think_s": 0.05,
            },
            requests=24,
        ),
    ],
}


def _host_path() -> str | None:
    """Put FastDeploy (``FDFLEET_HOST_FASTDEPLOY``, else :data:`HOST_DEFAULT` where it exists) first on
    ``sys.path``; plugins on. What is missing, in one line with how to provide it, or ``None`` when
    ``fastdeploy`` can be imported."""
    import importlib.util

    host = os.environ.get(HOST_VAR, "").strip()
    where = Path(host or HOST_DEFAULT).expanduser()
    if where.is_dir():
        sys.path.insert(0, str(where))
    os.environ.setdefault("FD_PLUGINS", "paddlefleet")
    if importlib.util.find_spec("fastdeploy") is not None:
        return None
    told = f"{HOST_VAR}={host!r}" if host else f"{HOST_VAR} is unset and {HOST_DEFAULT}"
    return (
        f"FastDeploy is not importable: {told} holds no fastdeploy/ package and none is installed; "
        f"set {HOST_VAR} to a folder holding FastDeploy's fastdeploy/ sources (README.md, "
        "'Conformance tests against the hosts' real code', says where to get them)"
    )


def _rows_problem(data: dict[str, Any]) -> str | None:
    """What keeps ``data`` (an earlier run's JSON) from being merged or replotted, or ``None``."""
    rows = data["rows"]
    if not isinstance(rows, list) or not rows:
        return "'rows' is not a non-empty list"
    for i, r in enumerate(rows):
        missing = [k for k in ROW_KEYS if k not in r] if isinstance(r, dict) else list(ROW_KEYS)
        if missing:
            return f"row {i} lacks {', '.join(missing)}"
    if not isinstance(data.get("bounds") or [], list):
        return "'bounds' is not a list"
    return None


def measured_decode_gbps(path: Path = HERE / "results" / "attention-h200.jsonl") -> float:
    """The best decode bandwidth the H200 attention benchmark measured (GB/s)."""
    best = 0.0
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row.get("kind") == "decode" and "gbps" in row:
                best = max(best, float(row["gbps"]))
    return best


def _key(row: dict[str, Any]) -> tuple:
    return (
        row.get("workload", "prefill-heavy"),
        row["model"],
        row["context"],
        row.get("seqs", "512"),
        row["mode"],
    )


def _extend_models() -> None:
    import headwise_sim as hs

    for key, value in MODELS_EXTRA.items():
        hs.MODELS.setdefault(key, value)


def _plan(name: str) -> Any:
    from fastdeploy_paddlefleet.plan import plan_from_config
    from fastdeploy_paddlefleet.presets import load_preset

    return plan_from_config(load_preset(name))


def kv_blocks(plan: Any, kv_bytes: int) -> tuple[Any, int, int]:
    """``(layout, FastDeploy's num_gpu_blocks, the pool's)`` for ``kv_bytes`` of KV memory:
    FastDeploy prices a block at every layer's own shape (``layer_elements``), the pool at
    ``block_bytes`` (the same for the presets: nothing padded)."""
    from fastdeploy_paddlefleet.kvcache.layout import dtype_bytes
    from fastdeploy_paddlefleet.kvcache.pools import budget_blocks, pool_layout

    layout = pool_layout(plan, BLOCK)
    return (
        layout,
        kv_bytes // (layout.layer_elements * dtype_bytes(DTYPE)),
        budget_blocks(layout, kv_bytes, DTYPE),
    )


def capacities(plan: Any, kv_bytes: int, context: int, max_seqs: int | None = None) -> tuple[int, int]:
    """``(FastDeploy's requests, the one pool's)`` held at once at ``context`` tokens in ``kv_bytes``
    (``pools.capacity``, each mode at its own block count), capped at ``max_seqs``."""
    from fastdeploy_paddlefleet.kvcache.pools import capacity

    layout, fd_blocks, pool_blocks = kv_blocks(plan, kv_bytes)
    kw = {"max_num_batched_tokens": BATCHED, "max_num_seqs": max_seqs}
    return (
        capacity(layout, fd_blocks, context, **kw).fastdeploy_requests,
        capacity(layout, pool_blocks, context, **kw).recycling_requests,
    )


def max_num_seqs_for(setting: str, name: str, prompt: int, kv_bytes: int) -> int:
    """``max_num_seqs`` of a setting (module docstring): ``512``, or ``non-binding`` = 1.25 x the
    most requests either mode holds at once at ``prompt`` tokens."""
    if setting == "512":
        return MAX_SEQS
    if setting != "non-binding":
        raise ValueError(f"max_num_seqs setting must be one of {SEQS}, got {setting!r}")
    return math.ceil(SEQS_MARGIN * max(capacities(_plan(name), kv_bytes, prompt)))


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _scheduler(
    name: str,
    shape: Shape,
    recycling: bool,
    prefix: bool | None,
    budget: int | None,
    work: Path,
    max_seqs: int,
) -> tuple[Any, ...]:
    """FastDeploy's real scheduler for ``name`` at ``shape``: the preset's KV bytes as FastDeploy's
    blocks (or the recycling pool's), the hook on or off, FastDeploy's prefix caching switch set
    where ``prefix`` is not None. Returns ``(rm, rec, layout, num_blocks, kv_bytes, usage,
    step_time)``: ``step_time`` prices a step by the step model and records the KV usage in
    ``usage``."""
    import headwise_sim as hs
    from _scheduler_sim import make_config, make_manager, recycler_of

    from fastdeploy_paddlefleet.plan import plan_from_config
    from fastdeploy_paddlefleet.presets import load_preset
    from fastdeploy_paddlefleet.serving.modeldir import write_model_dir

    _extend_models()
    model = hs.build_model(name)
    kv_bytes = hs.kv_budget_bytes(model) if budget is None else budget
    d = work / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(load_preset(name)))
    plan = plan_from_config(str(d))
    layout, fd_blocks, pool_blocks = kv_blocks(plan, kv_bytes)
    num_blocks = pool_blocks if recycling else fd_blocks
    tiny = work / "tiny"
    if not (tiny / "config.json").exists():
        write_model_dir("tiny", tiny, dtype="float32", seed=5)
    os.environ["FDFLEET_KV_RECYCLE"] = "auto" if recycling else "off"
    cfg = make_config(
        str(tiny),
        max_model_len=shape.max_model_len,
        max_num_seqs=min(max_seqs, FD_MAX_SEQS_LIMIT),
        max_num_batched_tokens=BATCHED,
        block_size=BLOCK,
        num_blocks=int(num_blocks),
    )
    # beyond FastDeploy's limit (FDConfig.check refuses more than 512): a what-if, set after the
    # check; the scheduler and the hook read it from here (slots, the pool's concurrency)
    cfg.scheduler_config.max_num_seqs = max_seqs
    if prefix is not None:
        # FastDeploy's switch (EngineArgs turns it off on the CPU platform; on, as on a GPU, where asked)
        cfg.cache_config.enable_prefix_caching = prefix
    rm = make_manager(cfg, str(d))
    rec = recycler_of(rm)
    if (rec is not None) != recycling:
        raise RuntimeError(f"{name}: recycling {recycling} but recycler {rec!r}")
    if rec is not None and rec.num_pages != layout.num_pages(num_blocks):
        raise RuntimeError(
            f"{name}: the hook's pool has {rec.num_pages} pages, the layout {layout.num_pages(num_blocks)}"
        )
    usage = {"peak": 0.0, "sum": 0.0, "steps": 0, "decode": 0, "decode_steps": 0}

    def step_time(dec: list[int], ch: list[tuple[int, int]]) -> float:
        u = rm.get_gpu_cache_usage_perc()  # the pool's usage in recycling mode (the hook's)
        usage["peak"] = max(usage["peak"], u)
        usage["sum"] += u
        usage["steps"] += 1
        if dec:
            usage["decode"] += len(dec)
            usage["decode_steps"] += 1
        return hs.step_time(model, dec, ch)

    return rm, rec, layout, num_blocks, kv_bytes, usage, step_time


def _run_fields(
    st: Any,
    sim: Any,
    usage: dict,
    rec: Any,
    layout: Any,
    num_blocks: int,
    kv_bytes: int,
    max_seqs: int,
    requested: int,
    t0: float,
) -> dict[str, Any]:
    """The figures every row reports, from the run's stats, the sim's clock and the KV usage."""
    pools = (
        {"pages": rec.num_pages, "pages_per_block": layout.pages_per_block, "groups": len(layout.groups)}
        if rec is not None
        else {"blocks": int(num_blocks)}
    )
    return {
        "max_num_seqs": max_seqs,
        "beyond_fastdeploy_limit": max_seqs > FD_MAX_SEQS_LIMIT,
        "cap_reached": st.peak_running >= max_seqs,
        "kv_bytes": kv_bytes,
        "num_gpu_blocks": int(num_blocks),
        "pools": pools,
        "peak_running": st.peak_running,
        "steps": st.steps,
        "output_tokens": st.tokens,
        "requested_output_tokens": requested,
        "prefill_tokens_run": st.prefill_tokens,
        "seconds_simulated": sim.clock,
        "tokens_per_s": st.tokens / sim.clock if sim.clock else 0.0,
        "ttft_p50_s": _pct(st.ttft, 0.5),
        "ttft_p99_s": _pct(st.ttft, 0.99),
        "preempted": st.preempted,
        "kv_usage_peak": usage["peak"],
        "kv_usage_mean": usage["sum"] / max(1, usage["steps"]),
        "mean_decode_batch": usage["decode"] / max(1, usage["decode_steps"]),
        "wall_s": round(time.time() - t0, 2),
    }


def run_one(
    name: str,
    shape: Shape,
    n_req: int,
    mode: str,
    budget: int | None,
    work: Path,
    max_seqs: int = MAX_SEQS,
) -> dict[str, Any]:
    from _scheduler_sim import Sim, Trace

    rm, rec, layout, num_blocks, kv_bytes, usage, step_time = _scheduler(
        name, shape, mode == "recycling", None, budget, work, max_seqs
    )
    sim = Sim(rm, 0, check=False, step_time=step_time)
    arrivals = shape.arrivals(n_req)
    t0 = time.time()
    st = sim.run(Trace(arrivals, {}), 10**7)
    requested = sum(a[3] for a in arrivals)
    if st.tokens != requested:
        raise RuntimeError(f"{name} {shape.workload} {mode}: {st.tokens} output tokens of {requested}")
    return {
        "model": name,
        **shape.describe(),
        "requests": n_req,
        "mode": mode,
        "prompt_tokens": sum(a[2] for a in arrivals),
        **_run_fields(st, sim, usage, rec, layout, num_blocks, kv_bytes, max_seqs, requested, t0),
    }


def run_chat_one(
    name: str,
    shape: Shape,
    conversations: int,
    mode: str,
    budget: int | None,
    work: Path,
    max_seqs: int = MAX_SEQS,
) -> dict[str, Any]:
    """One shared-prefix row: ``shape.chat_trace(conversations)`` through FastDeploy's real scheduler
    in one of :data:`PREFIX_MODES` (``_prefix_trace.ChatSim``, a worker without lag, each forward
    priced by the step model); the counts of cached tokens are FastDeploy's own."""
    from _prefix_trace import ChatSim

    modes = {m: (rc, pc) for m, rc, pc in PREFIX_MODES}
    if mode not in modes:
        raise ValueError(f"shared-prefix mode must be one of {sorted(modes)}, got {mode!r}")
    recycling, prefix = modes[mode]
    rm, rec, layout, num_blocks, kv_bytes, usage, step_time = _scheduler(
        name, shape, recycling, prefix, budget, work, max_seqs
    )
    kept = bool(rm.config.cache_config.enable_prefix_caching)  # the hook may have switched it off
    trace = shape.chat_trace(conversations)
    sim = ChatSim(rm, 0, check=False, step_time=step_time)
    t0 = time.time()
    st, chat = sim.run_chat(trace, 10**7)
    requested = sum(t.max_tokens for c in trace.convs for t in c)
    if st.tokens != requested:
        raise RuntimeError(f"{name} shared-prefix {mode}: {st.tokens} output tokens of {requested}")
    return {
        "model": name,
        **shape.describe(),
        "trace": trace.describe(),
        "conversations": conversations,
        "requests": trace.requests,
        "mode": mode,
        "recycling": recycling,
        "prefix_caching_asked": prefix,
        "prefix_caching": kept,
        "prompt_tokens": chat.prompt_tokens,
        "cached_tokens_served": chat.served,
        "prefix_cache_token_num": chat.served_metric,
        "prefix_hit_requests": chat.hit_requests,
        **_run_fields(st, sim, usage, rec, layout, num_blocks, kv_bytes, max_seqs, requested, t0),
    }


def decode_bound(
    name: str, prompt: int, out: int, max_seqs: int | None = None, weights: str = "bf16"
) -> dict[str, Any]:
    """The most recycling can raise tokens/s in the step model (module docstring, NOTES).

    ``prompt`` / ``out``: the workload's prompt and output tokens (the decode phase is priced at
    the mean context ``c = prompt + out // 2``); ``max_seqs``: the ``max_num_seqs`` cap on both
    modes' concurrency (None: none); ``weights``: ``bf16`` (what the plugin serves) or ``mxfp4``
    (the routed experts at 4.25 bits, the KV budget grown by what that frees)."""
    import dataclasses

    import headwise_sim as hs

    if weights not in ("bf16", "mxfp4"):
        raise ValueError(f"weights must be 'bf16' or 'mxfp4', got {weights!r}")
    _extend_models()
    model = hs.build_model(name)
    if weights == "mxfp4":
        model = dataclasses.replace(model, expert_bytes=model.expert_bytes / hs.WEIGHT_BYTES * MXFP4_BYTES)
    kv_bytes = hs.kv_budget_bytes(model)
    c = prompt + out // 2
    b_fd, b_rc = capacities(model.plan, kv_bytes, c, max_seqs)
    # one request's attention bytes per decode step: full lanes read c keys, sliding ones W + 1,
    # plus the new token's K/V written
    kv_req = model.full_kv * c + sum(b * min(c, w + 1) for w, b in model.sliding_kv.items())
    t_kv = (kv_req + model.bytes_per_token) / hs.BW
    t_fd = hs.step_time(model, [c] * b_fd, [])
    t_rc = hs.step_time(model, [c] * b_rc, [])
    t_w = t_fd - b_fd * t_kv  # overhead + weights (attention is bandwidth-bound at these sizes)
    r = b_rc / b_fd
    formula = r * (t_w + b_fd * t_kv) / (t_w + r * b_fd * t_kv)
    # prefill of one prompt (the same compute in both modes), chunked at max_num_batched_tokens
    chunks = [(s, min(BATCHED, prompt - s)) for s in range(0, prompt, BATCHED)]
    t_pf = sum(hs.step_time(model, [], [ch]) - hs.OVERHEAD_S for ch in chunks)
    return {
        "model": name,
        "prompt": prompt,
        "output": out,
        "mean_context": c,
        "max_num_seqs": max_seqs,
        "weights": weights,
        "weight_bytes": model.dense_bytes + model.expert_bytes,
        "kv_bytes": kv_bytes,
        "fastdeploy_requests": b_fd,
        "recycling_requests": b_rc,
        "r": r,
        "t_w_ms": t_w * 1e3,
        "t_kv_us": t_kv * 1e6,
        "B_t_kv_ms": b_fd * t_kv * 1e3,
        "gain_bound": formula,
        "gain_bound_exact": (b_rc / t_rc) / (b_fd / t_fd),
        "gain_bound_r_inf": 1 + t_w / (b_fd * t_kv),
        "prefill_s": t_pf,
        "gain_estimate_end_to_end": (t_pf + out * t_fd / b_fd) / (t_pf + out * t_rc / b_rc),
    }


def decode_bounds(presets: list[str]) -> list[dict[str, Any]]:
    """:func:`decode_bound` for every fixed-length workload and ``max_num_seqs`` setting of
    ``presets`` (the mixed one has no single length), and gpt-oss-20b with MXFP4 experts."""
    kv = {}
    rows = []
    import headwise_sim as hs

    _extend_models()
    for name in presets:
        kv[name] = hs.kv_budget_bytes(hs.build_model(name))
        fixed = [s for w in WORKLOADS for s in shapes(w, name) if s.fixed]
        for s in fixed:
            prompt, out = s.prompt[0], s.output[0]
            for seqs in SEQS:
                cap = max_num_seqs_for(seqs, name, prompt, kv[name])
                variants = ("bf16", "mxfp4") if name == "gpt-oss-20b" else ("bf16",)
                for w in variants:
                    rows.append(
                        {
                            "workload": s.workload,
                            "context": s.context,
                            "seqs": seqs,
                            **decode_bound(name, prompt, out, cap, w),
                        }
                    )
    return rows


def prefix_gains(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per shared-prefix (model, context): ``recycling-prefix`` over each other mode, output tokens/s
    and TTFT p50 (ratios; TTFT below 1 is better), and whether the hook kept prefix caching on."""
    by = {_key(r): r for r in rows if r.get("workload") == "shared-prefix"}
    out = {}
    for workload, name, ctx, seqs in sorted({k[:4] for k in by}):
        got = {m: by.get((workload, name, ctx, seqs, m)) for m, _, _ in PREFIX_MODES}
        if any(v is None for v in got.values()):
            continue
        both, fdp, rc = got["recycling-prefix"], got["fastdeploy-prefix"], got["recycling"]
        out[f"{name}@{ctx} shared-prefix max_num_seqs={seqs}"] = {
            "tokens_per_s_vs_fastdeploy_prefix": both["tokens_per_s"] / max(1e-12, fdp["tokens_per_s"]),
            "tokens_per_s_vs_recycling": both["tokens_per_s"] / max(1e-12, rc["tokens_per_s"]),
            "ttft_p50_vs_fastdeploy_prefix": both["ttft_p50_s"] / max(1e-12, fdp["ttft_p50_s"]),
            "ttft_p50_vs_recycling": both["ttft_p50_s"] / max(1e-12, rc["ttft_p50_s"]),
            "prefix_caching_kept": bool(both.get("prefix_caching")),
        }
    return out


SHORT = {
    "gpt-oss-20b": "gpt-oss-20b",
    "mimo-v2-flash-like": "MiMo-like",
    "gemma3-27b": "Gemma-3-27B",
    "ernie-4.5-21b-a3b-headwise": "ERNIE hw",
}


def _label(workload: str, model: str, context: int, seqs: int) -> str:
    star = "*" if seqs > FD_MAX_SEQS_LIMIT else ""
    what = {
        "prefill-heavy": f"{context // 1024}k",
        "decode-heavy": f"{context // 1024}k dec",
        "short": f"short {context}",
        "mixed": f"mixed {context // 1024}k",
    }.get(workload, f"{workload} {context}")
    return f"{SHORT.get(model, model)} {what} seqs {seqs}{star}"


def plot(rows: list[dict[str, Any]], path: Claim, bounds: list[dict[str, Any]] | None = None) -> None:
    """Recycling / FastDeploy's accounting per (workload, model, context, max_num_seqs): tokens/s
    (with the step model's bounds, bf16), peak running, TTFT p50; one colour per workload. Shared-prefix
    rows (three modes) get two panels of their own: output tokens/s and TTFT p50 per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    order = {m: i for i, m in enumerate(PRESETS)}
    worder = {w: i for i, w in enumerate(WORKLOADS)}
    chats = [r for r in rows if r.get("workload") == "shared-prefix"]
    rows = [r for r in rows if r.get("workload") != "shared-prefix"]
    keys = sorted(
        {_key(r)[:4] for r in rows},
        key=lambda k: (worder.get(k[0], 9), order.get(k[1], 9), k[2], k[3] != "512"),
    )
    by = {_key(r): r for r in rows}
    labels = [
        _label(w, m, c, by[(w, m, c, q, "fastdeploy")].get("max_num_seqs", MAX_SEQS)) for w, m, c, q in keys
    ]
    colours = {
        "prefill-heavy": "tab:orange",
        "decode-heavy": "tab:purple",
        "short": "tab:green",
        "mixed": "tab:blue",
    }
    bound = {
        (b["workload"], b["model"], b["context"], b["seqs"]): b
        for b in bounds or ()
        if b["weights"] == "bf16"
    }
    n_panels = (3 if keys else 0) + (2 if chats else 0)
    fig, axes = plt.subplots(n_panels, 1, figsize=(max(10, 0.5 * len(keys)), 4.3 * n_panels), squeeze=False)
    axes = list(axes[:, 0])
    if chats:
        _plot_chats(chats, axes[-2:], order)
        axes = axes[:-2]
    panels = (
        ("tokens_per_s", "output tokens/s, recycling / FastDeploy", 1.6),
        ("peak_running", "peak running requests, recycling / FastDeploy", None),
        ("ttft_p50_s", "TTFT p50, recycling / FastDeploy (lower is better)", None),
    )
    for ax, (metric, title, target) in zip(axes, panels if keys else (), strict=True):
        vals = [
            by[(w, m, c, q, "recycling")][metric] / max(1e-12, by[(w, m, c, q, "fastdeploy")][metric])
            for w, m, c, q in keys
        ]
        bars = ax.bar(range(len(keys)), vals, color=[colours.get(k[0], "grey") for k in keys])
        # tokens/s: values inside the bars (the bound marks sit above them)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, label_type="center" if target else "edge")
        ax.axhline(1.0, color="grey", lw=0.8)
        if target:
            handles = [Patch(color=colours[w], label=w) for w in WORKLOADS if any(k[0] == w for k in keys)]
            handles.append(
                ax.axhline(
                    target, color="tab:red", ls="--", lw=0.8, label=f"x{target} target (gpt-oss, MiMo at 8k)"
                )
            )
            for field, marker, name in (
                ("gain_bound_exact", "_", "decode-phase bound"),
                ("gain_estimate_end_to_end", "x", "end-to-end estimate (prefill included)"),
            ):
                xs = [i for i, k in enumerate(keys) if k in bound]
                handles.append(
                    ax.scatter(
                        xs, [bound[keys[i]][field] for i in xs], marker=marker, s=120, color="k", label=name
                    )
                )
            ax.legend(handles=handles, fontsize=7, ncol=2, loc="upper right")
        ax.set_xticks(range(len(keys)), labels, rotation=40, ha="right", fontsize=8)
        ax.set_xlim(-0.6, len(keys) - 0.4)
        ax.set_title(title, fontsize=9)
    fig.suptitle(
        "FastDeploy's real scheduler, same KV bytes: window recycling (one shared pool) vs FastDeploy's "
        "accounting (H200 step model)\n* max_num_seqs beyond FastDeploy's limit of 512: a what-if",
        fontsize=10,
    )
    # room for the two-line title above the first panel's own
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()) if chats else None)
    with replacing(path) as tmp:  # a claim (benchmarks/_outputs.py)
        fig.savefig(tmp, dpi=110)
    plt.close(fig)


def _plot_chats(chats: list[dict[str, Any]], axes: list[Any], order: dict[str, int]) -> None:
    """The shared-prefix panels: output tokens/s and TTFT p50 of each mode, grouped per model."""
    colours = {"fastdeploy-prefix": "tab:grey", "recycling": "tab:orange", "recycling-prefix": "tab:green"}
    groups = sorted({(r["model"], r["context"]) for r in chats}, key=lambda k: (order.get(k[0], 9), k[1]))
    by = {(r["model"], r["context"], r["mode"]): r for r in chats}
    modes = [m for m, _, _ in PREFIX_MODES]
    width = 0.8 / len(modes)
    for ax, (metric, title) in zip(
        axes,
        (
            (
                "tokens_per_s",
                "shared-prefix chats (2k system prompt, multi-turn, same KV bytes): output tokens/s",
            ),
            ("ttft_p50_s", "TTFT p50 (s, lower is better)"),
        ),
        strict=True,
    ):
        for j, mode in enumerate(modes):
            xs = [i + (j - (len(modes) - 1) / 2) * width for i in range(len(groups))]
            vals = [by[(m, c, mode)][metric] if (m, c, mode) in by else 0.0 for m, c in groups]
            label = mode
            if mode == "recycling-prefix" and any(
                not by[(m, c, mode)].get("prefix_caching", True) for m, c in groups if (m, c, mode) in by
            ):
                label += " (prefix caching switched off by the hook)"
            bars = ax.bar(xs, vals, width, color=colours[mode], label=label)
            ax.bar_label(bars, fmt="%.3g", fontsize=7)
        ax.set_xticks(range(len(groups)), [f"{SHORT.get(m, m)} {c // 1024}k" for m, c in groups], fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=f"Needs FastDeploy's Python sources: {HOST_VAR}, default {HOST_DEFAULT} (README.md, "
        "'Conformance tests against the hosts' real code'), or an installed fastdeploy; no GPU. Without "
        "them it exits 2 naming the variable.",
    )
    p.add_argument("--out", help="JSON path (default: a fresh temporary directory)")
    p.add_argument("--plot", help="plot path (default: the JSON path with .png)")
    p.add_argument("--smoke", action="store_true", help="a tiny run (seconds); never the committed results")
    p.add_argument("--models", nargs="*", default=None, help=f"presets (default {PRESETS})")
    p.add_argument("--json", action="store_true", help="print the JSON summary on stdout")
    p.add_argument("--replot", metavar="JSON", help="only redraw the plot of an earlier run's JSON")
    p.add_argument(
        "--workload",
        choices=(*WORKLOADS, "all"),
        nargs="+",
        default=["all"],
        help="prefill-heavy: prompt = context - 1024, 1024 generated (4 models, 8k and 32k); "
        "decode-heavy: 1024-token prompts, the rest generated (gpt-oss, MiMo-like at 8k); "
        "short: 256 + 256 tokens (4 models); mixed: 70%% short, 30%% long requests (4 models); "
        "shared-prefix: multi-turn chats sharing a 2048-token system prompt, FastDeploy's prefix caching "
        "without recycling, recycling without it, and both (gpt-oss, MiMo-like at 8k; with --smoke only "
        "when named); default all",
    )
    p.add_argument(
        "--seqs",
        choices=(*SEQS, "all"),
        default="all",
        help="max_num_seqs setting: 512, or non-binding (1.25 x what the pools hold at the prompt length); "
        "default all",
    )
    p.add_argument("--merge", metavar="JSON", help="keep an earlier run's rows that this run does not redo")
    p.add_argument("--force", action="store_true", help=force_help("the --out and --plot files"))
    args = p.parse_args(argv)
    if args.replot:
        try:
            data = read_json(args.replot, "--replot", keys=("rows",), check=_rows_problem)
            png = plot_path(args.plot, Path(args.replot), smoke=False)
            plot(data["rows"], claim(png, script=SCRIPT, force=args.force, flag="--plot", beside=args.replot),
                 data.get("bounds"))  # fmt: skip
        except ValueError as e:
            return fail(e)
        except (KeyError, TypeError) as e:  # rows of another shape than this script's
            return fail(Refused(f"--replot {args.replot!r}: a row is not what this script writes ({e!r})"))
        print(json.dumps({"plot": str(png)}) if args.json else f"wrote {png}")
        return 0
    logging.basicConfig(level=logging.WARNING)
    try:  # what this run writes, reads and needs: refused by name before any work
        out = output_path(
            args.out, name="serving_sim.json", suffixes=(".json",), what="JSON", smoke=args.smoke
        )
        png = plot_path(args.plot, out, smoke=args.smoke)
        out_claim = claim(out, script=SCRIPT, force=args.force)
        png_claim = claim(png, script=SCRIPT, force=args.force, flag="--plot", beside=out)
        merged = read_json(args.merge, "--merge", keys=("rows",), check=_rows_problem) if args.merge else None
        missing = _host_path()
        if missing:
            raise Refused(missing)
        try:
            import fastdeploy  # noqa: F401  (loads the plugin's early hook, which patches the scheduler)
        except ImportError as e:
            raise Refused(f"FastDeploy is there but does not import ({type(e).__name__}: {e})") from None
    except ValueError as e:
        return fail(e)
    from tqdm import tqdm

    from fastdeploy_paddlefleet.serving.kv_recycling.scheduler import install

    if not install():
        raise SystemExit("FastDeploy's ResourceManagerV1 could not be imported (set FDFLEET_HOST_FASTDEPLOY)")
    presets = SMOKE["presets"] if args.smoke else (args.models or PRESETS)
    budget = SMOKE["budget"] if args.smoke else None
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="fdfleet-serving-sim-"))
    settings = SEQS if args.seqs == "all" else (args.seqs,)
    workloads = WORKLOADS if "all" in args.workload else tuple(w for w in WORKLOADS if w in args.workload)
    if args.smoke:
        settings = ("512",)
        jobs = [
            (s, m, q) for m in presets for s in SMOKE["shapes"] if s.workload in workloads for q in settings
        ]
        if "shared-prefix" in args.workload:  # only when named (SMOKE)
            jobs += [(s, m, q) for m in presets for s in SMOKE["prefix_shapes"] for q in settings]
    else:
        jobs = [
            (s, m, q)
            for w in workloads
            for m in presets
            for s in shapes(w, m)
            for q in settings
            if s.chat is None or q == "512"  # shared-prefix: max_num_seqs 512 only
        ]
    rows = merged["rows"] if merged else []
    for r in rows:  # rows of runs before the settings existed: max_num_seqs 512
        r.setdefault("workload", "prefill-heavy")
        r.setdefault("seqs", "512")
        r.setdefault("max_num_seqs", MAX_SEQS)
        r.setdefault("cap_reached", r["peak_running"] >= r["max_num_seqs"])
    import headwise_sim as hs

    _extend_models()
    t_start = time.time()
    for shape, name, seqs in tqdm(jobs, desc="serving sim", disable=args.json):
        kv_bytes = hs.kv_budget_bytes(hs.build_model(name)) if budget is None else budget
        cap = max_num_seqs_for(seqs, name, shape.shortest_prompt, kv_bytes)
        n = shape.requests
        if n <= 0:  # saturated: twice what the recycling pool holds at the sizing length
            n = max(16, 2 * capacities(_plan(name), kv_bytes, shape.size_at, cap)[1])
        runner = run_chat_one if shape.chat is not None else run_one
        modes = [m for m, _, _ in PREFIX_MODES] if shape.chat is not None else ["fastdeploy", "recycling"]
        for mode in modes:
            row = {"seqs": seqs, **runner(name, shape, n, mode, budget, work, cap)}
            rows = [r for r in rows if _key(r) != _key(row)] + [row]
            if not args.json:
                tqdm.write(
                    f"{shape.workload} {name} {shape.context} seqs={seqs} {mode}: n {n}, "
                    f"peak {row['peak_running']}, "
                    f"{row['tokens_per_s']:.0f} tok/s, preempted {row['preempted']}, wall {row['wall_s']} s"
                )
    gains = {}
    for workload, name, ctx, seqs in sorted({_key(r)[:4] for r in rows}):
        if workload == "shared-prefix":
            continue
        fd = next(r for r in rows if _key(r) == (workload, name, ctx, seqs, "fastdeploy"))
        rc = next(r for r in rows if _key(r) == (workload, name, ctx, seqs, "recycling"))
        suffix = ("" if workload == "prefill-heavy" else f" {workload}") + f" max_num_seqs={seqs}"
        gains[f"{name}@{ctx}{suffix}"] = {
            "tokens_per_s_gain": rc["tokens_per_s"] / fd["tokens_per_s"] - 1 if fd["tokens_per_s"] else None,
            "concurrency_ratio": rc["peak_running"] / max(1, fd["peak_running"]),
            "max_num_seqs": [fd["max_num_seqs"], rc["max_num_seqs"]],
        }
    result = {
        "meta": {
            "smoke": args.smoke,
            "block_size": BLOCK,
            "max_num_batched_tokens": BATCHED,
            "max_num_seqs": {
                "512": MAX_SEQS,
                "non-binding": f"{SEQS_MARGIN} x max requests at the shortest prompt",
            },
            "workloads": {
                "prefill-heavy": {
                    "contexts": [c for c, _, _ in CONTEXTS],
                    "output": 1024,
                    "max_model_len": "context + 512",
                },
                "decode-heavy": DECODE_HEAVY,
                "short": SHORT_WORKLOAD,
                "mixed": MIXED,
                "shared-prefix": {**SHARED_PREFIX, "modes": [m for m, _, _ in PREFIX_MODES]},
                "seed": SEED,
                "arrivals": "all at time 0; twice what the recycling pool holds at the sizing length",
            },
            "kv_pool": "one shared pool (kvcache/pools.py); FastDeploy's blocks at per-layer bytes",
            "bw_model_gbps": hs.BW / 1e9,
            "attention_h200_decode_gbps_measured": measured_decode_gbps(),
            "models_extra": MODELS_EXTRA,
            "weights": "bf16 (gpt-oss-20b's MXFP4 checkpoint is refused by the plugin; bounds price it too)",
            "wall_s_this_run": round(time.time() - t_start, 1),
        },
        "rows": rows,
        "gains": gains,
        "prefix_gains": prefix_gains(rows),
        "bounds": [] if args.smoke else decode_bounds(sorted({r["model"] for r in rows}, key=PRESETS.index)),
    }
    try:
        with replacing(out_claim) as tmp:
            tmp.write_text(json.dumps(mark(result, SCRIPT), indent=1) + "\n")
        plot(rows, png_claim, result["bounds"])
    except Refused as e:
        return fail(e)
    if args.json:
        print(json.dumps(result))
    else:
        for key, g in gains.items():
            print(f"{key}: tokens/s {g['tokens_per_s_gain']:+.0%}, concurrency x{g['concurrency_ratio']:.2f}")
        for key, g in result["prefix_gains"].items():
            print(
                f"{key}: recycling-prefix tokens/s x{g['tokens_per_s_vs_fastdeploy_prefix']:.3f} vs "
                f"fastdeploy-prefix, x{g['tokens_per_s_vs_recycling']:.3f} vs recycling; TTFT p50 "
                f"x{g['ttft_p50_vs_fastdeploy_prefix']:.3f} / x{g['ttft_p50_vs_recycling']:.3f}"
                f"{'' if g['prefix_caching_kept'] else ' (the hook switched prefix caching off)'}"
            )
        for b in result["bounds"]:
            print(
                f"bound {b['model']} {b['workload']} {b['context']} max_num_seqs={b['seqs']} {b['weights']}: "
                f"B {b['fastdeploy_requests']} -> {b['recycling_requests']}, t_w {b['t_w_ms']:.2f} ms, "
                f"B*t_kv {b['B_t_kv_ms']:.2f} ms, decode x{b['gain_bound_exact']:.3f}, "
                f"end to end x{b['gain_estimate_end_to_end']:.3f}"
            )
        print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
