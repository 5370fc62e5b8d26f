"""Tensor / expert parallelism from FastDeploy's groups.

FastDeploy's worker creates its groups before it builds the model
(``ParallelConfig.set_communicate_group``: ``parallel_config.tp_group`` over the
ranks ``[dp_rank * tp, (dp_rank + 1) * tp)``, ``parallel_config.ep_group`` when
expert parallelism is on) and allocates each rank's KV cache for ``kv_heads // tp``
heads. A model served on those caches must be sharded the same way:

* :func:`parallel_setup` reads sizes, ranks and groups from ``fd_config.parallel_config``
  and checks them (a ``ValueError`` naming the field).
* PaddleFleet models (built through PaddleFormers): :func:`init_paddlefleet_parallel_state`
  makes PaddleFleet's ``parallel_state`` agree with FastDeploy before the model is
  built: a fleet hybrid topology whose model-parallel degree is FastDeploy's
  ``tensor_parallel_size`` (expert degree ``expert_parallel_size``, sharding degree
  ``data_parallel_size``), PaddleFleet's model-parallel state initialised from it when
  absent or of another size, and its TP group's ranks checked against
  ``parallel_config.tp_group``. (FastDeploy's own in-tree fleet fallback, PR #8039/#8101,
  takes the same route; this is our implementation of it.) Exercised on CPU in two gloo
  processes with a stand-in ``paddlefleet.parallel_state`` (``tests/test_tp_fastdeploy.py``);
  never with the real PaddleFleet here.
* minifleet models (the embedded presets): :func:`shard_minifleet` shards a built
  model in place, Megatron style: QKV, output gate and MLP up/gate projections by
  columns (this rank's heads / inner units), output and MLP down projections by rows
  followed by an all-reduce over ``tp_group``; embeddings, norms and the LM head are
  replicated. It returns how each sharded weight is cut from the full checkpoint
  tensor, which ``PaddleFleetForCausalLM.set_state_dict`` applies when FastDeploy's
  loader streams full-size weights.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import paddle

from ._fields import field as _get

logger = logging.getLogger(__name__)

#: weight name -> (axis, [(start, stop), ...]): the rank's weight is the concatenation of the slices
ShardMap = dict[str, tuple[int, list[tuple[int, int]]]]


def _int(value: Any, default: int, name: str) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
        raise ValueError(f"fd_config.parallel_config.{name} must be an integer, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class ParallelSetup:
    """Sizes, ranks and groups of one FastDeploy worker (groups are ``None`` when the size is 1)."""

    tp_size: int = 1
    tp_rank: int = 0
    tp_group: Any = None
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: Any = None
    dp_size: int = 1

    @property
    def tensor_parallel(self) -> bool:
        return self.tp_size > 1

    @property
    def expert_parallel(self) -> bool:
        return self.ep_size > 1


def _group_size(group: Any) -> int | None:
    for attr in ("nranks", "world_size"):
        size = getattr(group, attr, None)
        if isinstance(size, int):
            return size
    return None


def parallel_setup(fd_config: Any) -> ParallelSetup:
    """The :class:`ParallelSetup` of ``fd_config.parallel_config`` (checked)."""
    pc = _get(fd_config, "parallel_config")
    tp = _int(_get(pc, "tensor_parallel_size"), 1, "tensor_parallel_size")
    tp_rank = _int(_get(pc, "tensor_parallel_rank"), 0, "tensor_parallel_rank")
    ep = _int(_get(pc, "expert_parallel_size"), 1, "expert_parallel_size")
    ep_rank = _int(_get(pc, "expert_parallel_rank"), 0, "expert_parallel_rank")
    dp = _int(_get(pc, "data_parallel_size"), 1, "data_parallel_size")
    if tp < 1 or ep < 1 or dp < 1:
        raise ValueError(f"parallel sizes must be >= 1, got tensor {tp}, expert {ep}, data {dp}")
    if not 0 <= tp_rank < tp:
        raise ValueError(f"fd_config.parallel_config.tensor_parallel_rank={tp_rank} is not in [0, {tp})")
    if not 0 <= ep_rank < ep:
        raise ValueError(f"fd_config.parallel_config.expert_parallel_rank={ep_rank} is not in [0, {ep})")
    tp_group = _get(pc, "tp_group") if tp > 1 else None
    if tp > 1:
        if tp_group is None:
            raise ValueError(
                f"fd_config.parallel_config.tp_group is None with tensor_parallel_size={tp}: the worker "
                "must create its groups (ParallelConfig.set_communicate_group) before building the model"
            )
        size = _group_size(tp_group)
        if size is not None and size != tp:
            raise ValueError(
                f"fd_config.parallel_config.tp_group has {size} ranks, tensor_parallel_size is {tp}"
            )
    ep_group = _get(pc, "ep_group") if ep > 1 else None
    return ParallelSetup(tp, tp_rank, tp_group, ep, ep_rank, ep_group, dp)


# -- PaddleFleet --------------------------------------------------------------------------------
def hybrid_degrees(setup: ParallelSetup) -> dict[str, Any]:
    """The fleet ``hybrid_configs`` whose model-parallel group is FastDeploy's TP group.

    Order puts ``mp`` innermost, so model-parallel groups are runs of consecutive ranks,
    as FastDeploy's ``tp_group`` is.
    """
    return {
        "dp_degree": 1,
        "mp_degree": setup.tp_size,
        "pp_degree": 1,
        "sep_degree": 1,
        "sharding_degree": setup.dp_size,
        "ep_degree": setup.ep_size,
        "cp_degree": 1,
        "moe_sharding_degree": 1,
        "order": ["pp", "moe_sharding", "ep", "dp", "sharding", "sep", "cp", "mp"],
    }


def _group_ranks(group: Any) -> list[int] | None:
    ranks = getattr(group, "ranks", None)
    return list(ranks) if ranks is not None else None


def init_paddlefleet_parallel_state(setup: ParallelSetup) -> str:
    """Make PaddleFleet's ``parallel_state`` use FastDeploy's TP/EP layout (before building the model).

    Returns a one-line description. Raises ``ValueError`` when PaddleFleet's TP group
    ends up with other ranks than ``parallel_config.tp_group``.
    """
    from paddle.distributed import fleet
    from paddlefleet import parallel_state

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = hybrid_degrees(setup)
    # FastDeploy's worker already ran fleet.init with mp only (init_distributed_environment):
    # drop that topology so fleet builds the one with the expert / sharding degrees too.
    import paddle.distributed.fleet.base.topology as topology
    import paddle.distributed.parallel_helper as parallel_helper

    topology._HYBRID_PARALLEL_GROUP = None
    parallel_helper.__parallel_ctx__clz__ = None
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()

    group = getattr(parallel_state, "_TENSOR_MODEL_PARALLEL_GROUP", None)
    if group is None or _group_size(group) != setup.tp_size:
        if setup.tp_size == 1:
            import paddle.distributed as dist

            parallel_state._TENSOR_MODEL_PARALLEL_GROUP = dist.new_group(ranks=[dist.get_rank()])
        else:
            parallel_state.initialize_model_parallel(hcg)
        group = getattr(parallel_state, "_TENSOR_MODEL_PARALLEL_GROUP", None)
    ours, theirs = _group_ranks(group), _group_ranks(setup.tp_group)
    if setup.tp_size > 1 and ours is not None and theirs is not None and ours != theirs:
        raise ValueError(
            f"PaddleFleet's tensor-parallel group has ranks {ours}, FastDeploy's "
            f"parallel_config.tp_group has {theirs}: the KV cache would not match the sharding"
        )
    try:
        from paddlefleet.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed=42)
    except (ImportError, AssertionError):  # seeded already, or an older PaddleFleet
        pass
    return f"PaddleFleet parallel_state: tp={setup.tp_size} ep={setup.ep_size} sharding={setup.dp_size}"


# -- minifleet ------------------------------------------------------------------------------------
class RowParallelLinear(paddle.nn.Linear):
    """``x [.., in / tp] @ W [in / tp, out]`` then a sum over the TP group (no bias)."""

    def __init__(self, in_features: int, out_features: int, group: Any) -> None:
        super().__init__(in_features, out_features, bias_attr=False)
        self.tp_group = group

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        out = super().forward(x)
        paddle.distributed.all_reduce(out, group=self.tp_group)
        return out


def cut(value: Any, axis: int, segments: Sequence[tuple[int, int]]) -> paddle.Tensor:
    """The rank's part of a full weight: the concatenation of ``value[start:stop]`` along ``axis``."""
    t = value if isinstance(value, paddle.Tensor) else paddle.to_tensor(value)
    parts = [paddle.slice(t, axes=[axis], starts=[a], ends=[b]) for a, b in segments]
    return parts[0] if len(parts) == 1 else paddle.concat(parts, axis=axis)


def _replace_linear(
    owner: paddle.nn.Layer, attr: str, axis: int, segments: list[tuple[int, int]], group: Any = None
) -> paddle.Tensor:
    old = getattr(owner, attr)
    if getattr(old, "bias", None) is not None:
        raise ValueError(f"{type(owner).__name__}.{attr} has a bias; minifleet TP shards bias-free linears")
    weight = cut(old.weight, axis, segments)
    fan_in, fan_out = int(weight.shape[0]), int(weight.shape[1])
    new = (
        RowParallelLinear(fan_in, fan_out, group)
        if group is not None
        else paddle.nn.Linear(fan_in, fan_out, bias_attr=False)
    )
    new.weight.set_value(weight.astype(new.weight.dtype))
    if new.weight.dtype != old.weight.dtype:
        new.to(dtype=old.weight.dtype)
    setattr(owner, attr, new)
    return weight


def _heads_range(total: int, tp: int, rank: int, what: str) -> tuple[int, int]:
    if total % tp:
        raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={tp}")
    n = total // tp
    return rank * n, (rank + 1) * n


def shard_minifleet(model: paddle.nn.Layer, setup: ParallelSetup) -> ShardMap:
    """Shard a built minifleet ``GPTModel`` in place for ``setup``'s TP rank; returns the cut map.

    GQA attention with a dense SwiGLU MLP only: MLA and MoE layers raise ``ValueError``
    (sharding them is not implemented). Heads must divide by the TP size.
    """
    from ..minifleet.attention import SelfAttention
    from ..minifleet.layers import SwiGLUMLP, TransformerLayer

    tp, rank, group = setup.tp_size, setup.tp_rank, setup.tp_group
    if tp == 1:
        return {}
    if group is None:
        raise ValueError("shard_minifleet needs setup.tp_group with tensor_parallel_size > 1")
    shards: ShardMap = {}
    for name, layer in model.named_sublayers():
        if not isinstance(layer, TransformerLayer):
            continue
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(attn, SelfAttention):
            raise ValueError(f"{name}: minifleet TP of {type(attn).__name__} is not implemented")
        if not isinstance(mlp, SwiGLUMLP):
            raise ValueError(f"{name}: minifleet TP of {type(mlp).__name__} is not implemented")
        hq, hkv, d, dv = attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.v_head_dim
        q0, q1 = _heads_range(hq, tp, rank, f"{name} num_attention_heads")
        k0, k1 = _heads_range(hkv, tp, rank, f"{name} num_key_value_heads")
        prefix = f"{name}.self_attn"
        qkv = [(q0 * d, q1 * d), (hq * d + k0 * d, hq * d + k1 * d)]
        qkv.append((hq * d + hkv * d + k0 * dv, hq * d + hkv * d + k1 * dv))
        _replace_linear(attn, "qkv_proj", 1, qkv)
        shards[f"{prefix}.qkv_proj.weight"] = (1, qkv)
        if attn.gate_proj is not None:
            _replace_linear(attn, "gate_proj", 1, [(q0 * dv, q1 * dv)])
            shards[f"{prefix}.gate_proj.weight"] = (1, [(q0 * dv, q1 * dv)])
        _replace_linear(attn, "o_proj", 0, [(q0 * dv, q1 * dv)], group)
        shards[f"{prefix}.o_proj.weight"] = (0, [(q0 * dv, q1 * dv)])
        attn.num_heads, attn.num_kv_heads = q1 - q0, k1 - k0

        core = attn.core_attention
        core.num_attention_heads_per_partition = q1 - q0
        core.num_query_groups_per_partition = k1 - k0
        core.hidden_size_per_partition = core.hidden_size_per_attention_head * (q1 - q0)
        sink = getattr(core, "softmax_offset", None)
        if sink is not None:
            part = cut(sink, 0, [(q0, q1)])
            if isinstance(sink, paddle.base.framework.EagerParamBase):
                param = core.create_parameter([q1 - q0], dtype=sink.dtype)
                param.set_value(part)
                core.softmax_offset = param
                shards[f"{prefix}.core_attention.softmax_offset"] = (0, [(q0, q1)])
            else:  # off-by-one: a constant zero row, not a weight
                core.softmax_offset = part

        f = int(mlp.down_proj.weight.shape[0])
        f0, f1 = _heads_range(f, tp, rank, f"{name} ffn_hidden_size")
        up_gate = [(f0, f1), (f + f0, f + f1)]  # [gate | up] halves, this rank's units of each
        _replace_linear(mlp, "up_gate_proj", 1, up_gate)
        shards[f"{name}.mlp.up_gate_proj.weight"] = (1, up_gate)
        _replace_linear(mlp, "down_proj", 0, [(f0, f1)], group)
        shards[f"{name}.mlp.down_proj.weight"] = (0, [(f0, f1)])
    logger.info("minifleet sharded for tensor parallel rank %d of %d: %d weights cut", rank, tp, len(shards))
    return shards


def foreign_expert_prefixes(model: paddle.nn.Layer) -> tuple[str, ...]:
    """Name prefixes of the experts other expert-parallel ranks own (``<layer>.experts.<id>.``).

    A full checkpoint names every expert; FastDeploy's loaders stream all of them to every rank,
    and each rank keeps its own (``PaddleFleetForCausalLM.set_state_dict`` skips these).
    """
    prefixes = []
    for name, layer in model.named_sublayers():
        ids = getattr(layer, "local_expert_ids", None)
        total = getattr(layer, "num_experts", None)
        if ids is None or not isinstance(total, int):
            continue
        prefixes += [f"{name}.experts.{e}." for e in range(total) if e not in set(ids)]
    return tuple(prefixes)
