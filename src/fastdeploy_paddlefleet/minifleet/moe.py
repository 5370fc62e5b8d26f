"""A tiny top-k mixture-of-experts MLP, optionally expert-parallel.

Routing: ``softmax(x @ gate)`` over ``num_experts`` in fp32, keep the top
``num_experts_per_tok``, renormalise them (``norm_topk_prob``, default on).
Each expert is a SwiGLU MLP ``down(silu(gate(x)) * up(x))``.

Expert parallelism (``expert_model_parallel_size`` = ``ep`` > 1, or an
``ep_group``): rank ``r`` of the group owns experts ``[r*E/ep, (r+1)*E/ep)``.
Gloo on CPU has neither ``alltoall`` nor ``reduce_scatter``, so dispatch and
combine are built from what every backend has:

1. ``all_gather`` of the token counts -> ``N = max(count)``;
2. ``all_gather`` of the tokens and their routes, padded to ``N`` rows
   (``N >= 1``: gloo cannot gather empty tensors);
3. each rank runs its own experts over every gathered token;
4. ``all_reduce`` (sum) of those partial outputs; each rank keeps its rows.

So every call of :meth:`MoEMLP.forward` runs collectives on every rank of
the group: a rank that skips a layer call leaves the others waiting. With
``ep == 1`` nothing is communicated.

Weights are deterministic from the seed the model was built with and do not
depend on ``ep``: the router draws from paddle's global generator (same
draws on every rank), and each expert's weights come from its own numpy
generator keyed by ``(base seed, layer, global expert id)``, where the base
seed is one draw from paddle's generator. An ``ep = 2`` rank therefore holds
exactly the slice of experts an ``ep = 1`` model built from the same seed has.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

logger = logging.getLogger(__name__)


def _field(config: Any, names: tuple[str, ...], default: Any = None) -> Any:
    """First present, non-None field of ``config`` (a mapping or an attribute object)."""
    for name in names:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if value is not None:
            return value
    return default


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


class SwiGLUExpert(nn.Layer):
    """One expert: ``[n, h] -> [n, h]``, weights drawn from ``rng``."""

    def __init__(self, hidden: int, ffn: int, rng: np.random.Generator, dtype: str) -> None:
        super().__init__()
        self.gate_proj = self._linear(hidden, ffn, rng, dtype)
        self.up_proj = self._linear(hidden, ffn, rng, dtype)
        self.down_proj = self._linear(ffn, hidden, rng, dtype)

    @staticmethod
    def _linear(fan_in: int, fan_out: int, rng: np.random.Generator, dtype: str) -> nn.Linear:
        layer = nn.Linear(fan_in, fan_out, bias_attr=False)
        weight = rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)
        layer.weight.set_value(paddle.to_tensor(weight.astype(dtype)))
        return layer

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEMLP(nn.Layer):
    """Top-k routed SwiGLU experts: ``forward(hidden [b, s, h]) -> [b, s, h]``.

    Config fields (PaddleFleet / HF names): ``hidden_size``, ``num_experts``
    (``n_routed_experts``), ``num_experts_per_tok`` (``moe_router_topk``),
    ``moe_intermediate_size`` (``moe_ffn_hidden_size``, else
    ``ffn_hidden_size`` / ``intermediate_size``), ``norm_topk_prob``
    (default True), ``expert_model_parallel_size`` (default 1).

    ``ep_group``: a ``paddle.distributed`` group of ``ep`` ranks; ``None``
    with ``ep > 1`` means the default (world) group, whose size must be ``ep``.
    """

    def __init__(self, config: Any, layer_index: int, ep_group: Any = None) -> None:
        super().__init__()
        self.layer_index = int(layer_index)
        hidden = _positive_int(_field(config, ("hidden_size",)), "hidden_size")
        self.num_experts = _positive_int(_field(config, ("num_experts", "n_routed_experts")), "num_experts")
        self.top_k = _positive_int(
            _field(config, ("num_experts_per_tok", "moe_router_topk"), 1), "num_experts_per_tok"
        )
        if self.top_k > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be <= num_experts ({self.num_experts}), got {self.top_k}"
            )
        ffn = _positive_int(
            _field(
                config,
                ("moe_intermediate_size", "moe_ffn_hidden_size", "ffn_hidden_size", "intermediate_size"),
            ),
            "moe_intermediate_size",
        )
        self.norm_topk_prob = bool(_field(config, ("norm_topk_prob",), True))
        self.hidden_size = hidden

        self.ep_group = ep_group
        if ep_group is not None:
            self.ep_size = int(ep_group.nranks)
            self.ep_rank = int(ep_group.rank)
        else:
            self.ep_size = _positive_int(
                _field(config, ("expert_model_parallel_size",), 1), "expert_model_parallel_size"
            )
            self.ep_rank = self._world_rank() if self.ep_size > 1 else 0
        if self.num_experts % self.ep_size:
            raise ValueError(
                f"num_experts ({self.num_experts}) must be divisible by "
                f"expert_model_parallel_size, got {self.ep_size}"
            )
        per_rank = self.num_experts // self.ep_size
        self.local_expert_ids = list(range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank))

        dtype = paddle.get_default_dtype()
        self.gate = nn.Linear(hidden, self.num_experts, bias_attr=False)
        # one draw from the global generator, identical on every rank and for every ep
        base_seed = int(paddle.randint(0, 2**31 - 1, [1]).item())
        # keyed by the GLOBAL expert id, so parameter names (experts.<id>....) match a
        # checkpoint and the single-process model whatever the rank holds
        experts = {}
        for e in self.local_expert_ids:
            rng = np.random.default_rng([base_seed, self.layer_index, e])
            experts[str(e)] = SwiGLUExpert(hidden, ffn, rng, dtype)
        self.experts = nn.LayerDict(experts)
        #: number of forward calls that ran the expert-parallel exchange (tests read it)
        self.dispatch_calls = 0

    def _world_rank(self) -> int:
        import paddle.distributed as dist

        if not dist.is_initialized():
            raise ValueError(
                f"expert_model_parallel_size={self.ep_size} needs paddle.distributed initialised "
                "(init_parallel_env) or an explicit ep_group"
            )
        world = dist.get_world_size()
        if world != self.ep_size:
            raise ValueError(
                f"expert_model_parallel_size={self.ep_size} differs from the world size {world}: "
                "pass an ep_group of that size"
            )
        return dist.get_rank()

    def set_ep_group(self, group: Any) -> None:
        """Use ``group`` for the exchange; its size and rank must match the experts held."""
        if group is not None and (int(group.nranks) != self.ep_size or int(group.rank) != self.ep_rank):
            raise ValueError(
                f"ep_group has nranks={group.nranks} rank={group.rank}, but layer {self.layer_index} "
                f"was built for ep_size={self.ep_size} ep_rank={self.ep_rank}"
            )
        self.ep_group = group

    def route(self, x: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        """``x [n, h]`` -> (expert ids ``[n, k]`` int64, weights ``[n, k]`` fp32)."""
        probs = F.softmax(self.gate(x).astype("float32"), axis=-1)
        weights, ids = paddle.topk(probs, self.top_k, axis=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdim=True)
        return ids, weights

    def _local_experts(self, x: paddle.Tensor, ids: paddle.Tensor, weights: paddle.Tensor) -> paddle.Tensor:
        """This rank's experts over ``x [n, h]``: their weighted sum ``[n, h]``."""
        out = paddle.zeros(x.shape, dtype="float32")
        for expert_id in self.local_expert_ids:
            expert = self.experts[str(expert_id)]
            hit = ids == expert_id  # [n, k]
            rows = paddle.nonzero(hit.any(axis=-1)).flatten()
            if rows.shape[0] == 0:
                continue
            w = (weights * hit.astype(weights.dtype)).sum(axis=-1)  # [n]
            y = expert(paddle.gather(x, rows)).astype("float32") * paddle.gather(w, rows).unsqueeze(-1)
            out = paddle.index_add(out, rows, 0, y)
        return out

    def forward(self, hidden_states: paddle.Tensor) -> paddle.Tensor:
        """``hidden_states [b, s, h]`` (or ``[n, h]``) -> same shape."""
        shape = hidden_states.shape
        if shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden_states last dim must be hidden_size={self.hidden_size}, got shape {list(shape)}"
            )
        x = hidden_states.reshape([-1, self.hidden_size])
        ids, weights = self.route(x)
        if self.ep_size == 1:
            out = self._local_experts(x, ids, weights)
        else:
            out = self._expert_parallel(x, ids, weights)
        return out.astype(hidden_states.dtype).reshape(shape)

    def _expert_parallel(self, x: paddle.Tensor, ids: paddle.Tensor, weights: paddle.Tensor) -> paddle.Tensor:
        import paddle.distributed as dist

        self.dispatch_calls += 1
        n = int(x.shape[0])
        counts: list[paddle.Tensor] = []
        dist.all_gather(counts, paddle.to_tensor([n], dtype="int64"), group=self.ep_group)
        counts_host = [int(c.item()) for c in counts]
        rows = max(max(counts_host), 1)  # gloo cannot gather empty tensors

        # one packed gather: [tokens | expert ids | weights], padded to `rows`
        packed = paddle.concat([x.astype("float32"), ids.astype("float32"), weights], axis=-1)
        if n < rows:
            pad = paddle.concat(
                [
                    paddle.zeros([rows - n, self.hidden_size], "float32"),
                    paddle.full([rows - n, self.top_k], -1.0, "float32"),  # expert -1: no expert's token
                    paddle.zeros([rows - n, self.top_k], "float32"),
                ],
                axis=-1,
            )
            packed = paddle.concat([packed, pad], axis=0)
        gathered: list[paddle.Tensor] = []
        dist.all_gather(gathered, packed, group=self.ep_group)
        every = paddle.concat(gathered, axis=0)  # [ep * rows, h + 2k]
        h, k = self.hidden_size, self.top_k
        all_x = every[:, :h].astype(x.dtype)
        all_ids = every[:, h : h + k].round().astype("int64")
        all_w = every[:, h + k :]
        partial = self._local_experts(all_x, all_ids, all_w)
        dist.all_reduce(partial, group=self.ep_group)
        start = self.ep_rank * rows
        return partial[start : start + n]
