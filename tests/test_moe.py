"""minifleet's ``MoEMLP`` (single process) against a per-token numpy routing reference; bad configs.

The two-process expert-parallel exchange is tested in ``test_ep_idle_rank.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

paddle = pytest.importorskip(
    "paddle", reason="needs Paddle (the CPU build in CI; the GPU machine has torch only)"
)

from fastdeploy_paddlefleet.minifleet.moe import MoEMLP  # noqa: E402

CFG = {"hidden_size": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8}


def dense_reference(moe: MoEMLP, x: np.ndarray, norm: bool = True) -> np.ndarray:
    """Token by token: softmax router, top-k, (renormalised) weighted SwiGLU experts, in numpy."""
    gate = moe.gate.weight.numpy()
    out = np.zeros_like(x)
    for t, token in enumerate(x):
        logits = token @ gate
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = np.argsort(-probs)[: moe.top_k]
        weights = probs[top] / probs[top].sum() if norm else probs[top]
        for e, w in zip(top, weights, strict=True):
            ex = moe.experts[str(int(e))]
            g = token @ ex.gate_proj.weight.numpy()
            u = token @ ex.up_proj.weight.numpy()
            out[t] += w * ((g / (1 + np.exp(-g))) * u) @ ex.down_proj.weight.numpy()
    return out


@pytest.mark.parametrize("norm", [True, False])
def test_moe_matches_per_token_reference(norm):
    paddle.seed(5)
    moe = MoEMLP(dict(CFG, norm_topk_prob=norm), layer_index=2)
    x = np.random.default_rng(0).standard_normal((2, 7, 16)).astype("float32")
    y = moe(paddle.to_tensor(x)).numpy()
    assert y.shape == x.shape
    ref = dense_reference(moe, x.reshape(-1, 16), norm).reshape(x.shape)
    assert np.abs(y - ref).max() <= 1e-5
    assert moe.dispatch_calls == 0  # ep == 1: no exchange


def test_moe_is_deterministic_from_the_seed_and_named_by_global_expert():
    paddle.seed(5)
    a = MoEMLP(CFG, layer_index=1)
    paddle.seed(5)
    b = MoEMLP(CFG, layer_index=1)
    for name, value in a.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), b.state_dict()[name].numpy())
    assert sorted(a.experts.keys()) == ["0", "1", "2", "3"]


def test_expert_parallel_rank_holds_its_slice_of_the_same_experts():
    group = SimpleNamespace(nranks=2, rank=1)  # only read at construction here
    paddle.seed(5)
    full = MoEMLP(CFG, layer_index=1)
    paddle.seed(5)
    part = MoEMLP(dict(CFG, expert_model_parallel_size=2), layer_index=1, ep_group=group)
    assert part.local_expert_ids == [2, 3] and (part.ep_size, part.ep_rank) == (2, 1)
    for name, value in part.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), full.state_dict()[name].numpy())


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"num_experts": None}, "num_experts"),
        ({"num_experts": 0}, "num_experts"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"moe_intermediate_size": -1}, "moe_intermediate_size"),
        ({"hidden_size": 2.5}, "hidden_size"),
        ({"expert_model_parallel_size": 0}, "expert_model_parallel_size"),
        ({"num_experts": 6, "expert_model_parallel_size": 4}, "divisible"),
    ],
)
def test_bad_moe_config_raises(overrides, match):
    cfg = dict(CFG, **overrides)
    with pytest.raises(ValueError, match=match):
        # divisibility is checked before the group is used: a fake world of the right size
        MoEMLP(cfg, 0, ep_group=SimpleNamespace(nranks=4, rank=0) if "divisible" in match else None)


def test_expert_parallel_without_a_process_group_raises():
    import paddle.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="expert_model_parallel_size=2"):
        MoEMLP(dict(CFG, expert_model_parallel_size=2), 0)


def test_wrong_hidden_size_and_mismatched_group_raise():
    moe = MoEMLP(CFG, 0)
    with pytest.raises(ValueError, match="hidden_size=16"):
        moe(paddle.zeros([1, 3, 8]))
    with pytest.raises(ValueError, match="ep_group"):
        moe.set_ep_group(SimpleNamespace(nranks=2, rank=0))
