"""PagedCoreAttention and patch_core_attention on minifleet.

References are the host's own modules: the original (unpatched) core
attention on the same q/k/v, or the unpatched twin model's logits.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

paddle = pytest.importorskip(
    "paddle", reason="needs Paddle (the CPU build in CI; the GPU machine has torch only)"
)

from fastdeploy_paddlefleet.adapter import PagedCoreAttention, StepContext, StepContextHolder  # noqa: E402
from fastdeploy_paddlefleet.backends.reference import ReferenceBackend  # noqa: E402
from fastdeploy_paddlefleet.minifleet import (  # noqa: E402
    AttnMaskType,
    TransformerLayer,
    build_minifleet,
    causal_startend_row_indices,
)
from fastdeploy_paddlefleet.patch import cache_plan, patch_core_attention, step_holder, unpatch_core_attention  # noqa: E402
from fastdeploy_paddlefleet.plan import plan_from_config  # noqa: E402
from fastdeploy_paddlefleet.runner.batch import PagedKVState, allocate_kv_caches  # noqa: E402
from fastdeploy_paddlefleet.runner.fleet_case import build_minifleet_case  # noqa: E402
from fastdeploy_paddlefleet.runner.verify import run_verify  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    native = build_minifleet("tiny", seed=0)
    return native, plan_from_config(native.config)


def patched_tiny(backend=None):
    model = build_minifleet("tiny", seed=0)
    plan = plan_from_config(model.config)
    report = patch_core_attention(model, plan, backend or ReferenceBackend())
    return model, plan, report


def one_request_step(plan, n, block_size=4):
    """A step context for one request of ``n`` tokens starting from an empty cache."""
    state = PagedKVState(16, block_size, 16, shuffle_seed=3)
    meta = state.schedule([("r", n)])
    caches = allocate_kv_caches(plan, 16, block_size)
    return StepContext(meta, caches, state.positions(meta))


def qkv(layer, s, seed=0):
    rng = np.random.default_rng(seed)
    shapes = (
        (1, s, layer.num_q_heads, layer.qk_head_dim),
        (1, s, layer.num_kv_heads, layer.qk_head_dim),
        (1, s, layer.num_kv_heads, layer.v_head_dim),
    )
    return [paddle.to_tensor(rng.standard_normal(shape).astype("float32")) for shape in shapes]


def test_signature_positional_keyword_kwargs_bshd_shd():
    model, plan, _ = patched_tiny()
    adapter = model.decoder.layers[2].self_attn.core_attention  # head-wise, learnable sink, v 8
    assert isinstance(adapter, PagedCoreAttention)
    layer = plan[2]
    q, k, v = qkv(layer, 9)
    # the host's own attention on its FlashMask path (the one head-wise / sliding layers take)
    rows = causal_startend_row_indices(1, 9)
    want = adapter.original()(q, k, v, None, rows, attn_mask_type=AttnMaskType.causal).numpy()
    holder = step_holder(model)
    calls = {
        "positional (recompute path)": lambda: adapter(
            q,
            k,
            v,
            None,
            None,
            "causal",
            None,
            None,
            False,
            None,
            None,
            False,
            None,
            None,
            None,
            None,
            None,
            None,
        ),
        "five positional, rest keyword": lambda: adapter(
            q,
            k,
            v,
            None,
            rows,
            attn_mask_type=AttnMaskType.causal,
            packed_seq_params=None,
            attention_bias=None,
        ),
        "all keyword + unknown kwargs": lambda: adapter(
            query=q, key=k, value=v, attention_mask=None, some_future_arg=1, another=None
        ),
    }
    for what, call in calls.items():
        with holder.step(one_request_step(plan, 9)):
            got = call()
        assert got.shape == [1, 9, layer.num_q_heads * layer.v_head_dim], what
        np.testing.assert_allclose(got.numpy(), want, atol=1e-5, err_msg=what)
    with holder.step(one_request_step(plan, 9)):
        got = adapter(q[0], k[0], v[0], None)  # SHD: [s, heads, dim]
    assert got.shape == [9, layer.num_q_heads * layer.v_head_dim]
    np.testing.assert_allclose(got.numpy(), want[0], atol=1e-5)
    with pytest.raises(ValueError, match="causal only"), holder.step(one_request_step(plan, 9)):
        adapter(q, k, v, None, rows, attn_mask_type=AttnMaskType.padding)


def test_mla_adapter_reads_kv_heads_from_the_plan_not_the_module():
    """PaddleFleet's MLA core attention reports the config's kv heads (2) while K/V carry 4."""
    model = build_minifleet("tiny-mla", seed=0)
    core = model.decoder.layers[0].self_attn.core_attention
    assert core.num_query_groups_per_partition == 2
    plan = plan_from_config(model.config)
    patch_core_attention(model, plan, ReferenceBackend())
    adapter = model.decoder.layers[0].self_attn.core_attention
    q, k, v = qkv(plan[0], 7)
    assert k.shape[2] == 4
    want = core(q, k, v, None, causal_startend_row_indices(1, 7), attn_mask_type=AttnMaskType.causal).numpy()
    with step_holder(model).step(one_request_step(plan, 7)):
        got = adapter(q, k, v, None, None, attn_mask_type=AttnMaskType.causal).numpy()
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_missing_step_context_raises_value_error():
    model, plan, _ = patched_tiny()
    adapter = model.decoder.layers[0].self_attn.core_attention
    with pytest.raises(ValueError, match="no step context"):
        adapter(*qkv(plan[0], 3), None)
    with pytest.raises(ValueError, match="no step context"):
        model(paddle.to_tensor([[1, 2, 3]], dtype="int64"))


def test_bad_shapes_and_token_count_raise():
    model, plan, _ = patched_tiny()
    adapter = model.decoder.layers[1].self_attn.core_attention
    q, k, v = qkv(plan[1], 5)
    with step_holder(model).step(one_request_step(plan, 5)):
        with pytest.raises(ValueError, match="value of layer 1 must have 2 heads of dim 8"):
            adapter(q, k, paddle.zeros([1, 5, 2, 16]), None)
        with pytest.raises(ValueError, match="query must be"):
            adapter(q.reshape([5, 64]), k, v, None)
    with step_holder(model).step(one_request_step(plan, 4)):
        with pytest.raises(ValueError, match="4 tokens"):
            adapter(q, k, v, None)


def test_sink_parameter_kept_under_softmax_offset(tiny):
    native, _ = tiny
    model = build_minifleet("tiny", seed=0)
    originals = [layer.self_attn.core_attention for layer in model.decoder.layers]
    keys_before = list(model.state_dict())
    patch_core_attention(model, plan_from_config(model.config), ReferenceBackend())
    assert list(model.state_dict()) == keys_before == list(native.state_dict())
    for original, layer in zip(originals, model.decoder.layers, strict=True):
        adapter = layer.self_attn.core_attention
        assert adapter.original() is original
        if "softmax_offset" in original._parameters:
            assert adapter.softmax_offset is original.softmax_offset  # the same Parameter object
            assert "softmax_offset" in dict(adapter.named_parameters())
    # a checkpoint's sink loads into the patched model (and reaches the paged path)
    name = "decoder.layers.1.self_attn.core_attention.softmax_offset"
    state = native.state_dict()
    state[name] = paddle.to_tensor([5.0, -5.0, 0.5, 2.0])
    model.set_state_dict(state)
    np.testing.assert_allclose(
        model.decoder.layers[1].self_attn.core_attention.softmax_offset.numpy(), [5, -5, 0.5, 2]
    )
    assert "softmax_offset" not in dict(model.decoder.layers[0].self_attn.core_attention.named_parameters())


def test_native_core_attention_never_called_after_patching(tiny):
    native, plan = tiny
    model, _, _ = patched_tiny()
    calls = []
    for layer in model.decoder.layers:
        layer.self_attn.core_attention.original().register_forward_pre_hook(lambda *a: calls.append(1))
    ids = paddle.to_tensor(np.random.default_rng(0).integers(0, 256, 11), dtype="int64")
    ctx = one_request_step(plan, 11)
    with paddle.no_grad(), step_holder(model).step(ctx):
        paged = model(ids.unsqueeze(0), position_ids=ctx.positions.unsqueeze(0))
    assert calls == []
    np.testing.assert_allclose(paged.numpy(), native(ids.unsqueeze(0)).numpy(), atol=1e-4)
    assert unpatch_core_attention(model) == 5
    model(ids.unsqueeze(0))
    assert len(calls) == 5


def test_unpatching_breaks_paged_parity():
    case = build_minifleet_case("tiny", ReferenceBackend(), seed=0)
    assert run_verify(case, decode_steps=2, progress=False).passed
    unpatch_core_attention(case.paged_logits.model)  # the case now runs the host's own attention per chunk
    # the paged path feeds no start/end rows: the host's sliding layers refuse its eager path
    with pytest.raises(ValueError, match="attn_mask_startend_row_indices"):
        run_verify(case, decode_steps=2, progress=False)
    full = {**build_minifleet("tiny").config.__dict__, "sliding_window": None, "head_wise_swa_ratio": 0.0}
    case = build_minifleet_case(full, ReferenceBackend(), seed=0)
    unpatch_core_attention(case.paged_logits.model)  # full attention: runs, per chunk, without context
    report = run_verify(case, decode_steps=2, progress=False)
    assert not report.passed and report.max_abs_logit_diff > 1e-2


@pytest.mark.parametrize("shift", [-1, 1, -4])
def test_wrong_window_breaks_parity(shift):
    """minifleet builds its masks from FlashMask rows, not from the plan: a window off by one
    (the plan reading ``(8, 0)`` as 9 keys, or 7) fails its parity check."""
    case = build_minifleet_case("tiny", ReferenceBackend(), seed=0)
    plan = case.plan
    wrong = dataclasses.replace(
        plan,
        layers=tuple(
            dataclasses.replace(l, window_left=l.window_left + shift) if l.window_left else l for l in plan
        ),
    )
    model = case.paged_logits.model
    unpatch_core_attention(model)
    patch_core_attention(
        model, wrong, ReferenceBackend(), holder=case.holder
    )  # windows are not cross-checked
    report = run_verify(case, decode_steps=2, progress=False)
    assert not report.passed and report.max_abs_logit_diff > 1e-3


class EqualDimsBackend(ReferenceBackend):
    """A backend that, like many kernels, needs v_head_dim == qk_head_dim."""

    name = "equal-dims"
    supports_unequal_v_dim = False

    def __init__(self):
        self.seen = []

    def check_layer(self, layer):
        if layer.v_head_dim != layer.qk_head_dim:
            raise ValueError(f"layer {layer.index}: v_head_dim != qk_head_dim")

    def forward(self, q, k, v, layer, meta, kv_cache, sinks=None):
        self.seen.append((q.shape[-1], v.shape[-1], kv_cache[1].shape[-1], layer.v_head_dim))
        return super().forward(q, k, v, layer, meta, kv_cache, sinks)


@pytest.mark.parametrize("preset", ["tiny-mla", "tiny"])
def test_value_padding_for_backend_needing_equal_dims(preset):
    backend = EqualDimsBackend()
    case = build_minifleet_case(preset, backend, seed=0)
    assert [l.v_head_dim for l in case.cache_plan] == [l.qk_head_dim for l in case.plan]
    report = run_verify(case, decode_steps=2, progress=False)
    assert report.passed, report.to_dict()
    assert backend.seen and all(dq == dv == dcache == lv for dq, dv, dcache, lv in backend.seen)
    assert any(l.v_head_dim != l.qk_head_dim for l in case.plan)  # something really was padded


class LinearAttention(paddle.nn.Layer):
    """Stands in for gated-delta-net / KDA: a self_attn without a core attention."""

    def __init__(self, hidden):
        super().__init__()
        self.proj = paddle.nn.Linear(hidden, hidden)

    def forward(self, hidden_states, *args):
        return self.proj(hidden_states)


def test_layer_without_core_attention_is_skipped_with_reason():
    model = build_minifleet("tiny", seed=0)
    model.decoder.layers[3].self_attn = LinearAttention(64)
    report = patch_core_attention(model, plan_from_config(model.config), ReferenceBackend())
    assert [p.layer_index for p in report.patched] == [0, 1, 2, 4]  # own count: layer 4 stays layer 4
    assert [s.name for s in report.skipped] == ["decoder.layers.3.self_attn"]
    assert "no core_attention" in report.skipped[0].reason
    assert report.to_dict()["skipped"][0]["reason"] == report.skipped[0].reason


def test_mtp_layers_are_patched_by_own_count():
    model = build_minifleet("tiny", seed=0)
    model.mtp_layers = paddle.nn.LayerList(
        [TransformerLayer(model.config, 4)]
    )  # an MTP block after the decoder
    plan = plan_from_config(model.config)
    with pytest.raises(ValueError, match="plan has no layer with index 5"):
        patch_core_attention(model, plan, ReferenceBackend())
    assert not any(isinstance(l, PagedCoreAttention) for l in model.sublayers())  # all-or-nothing
    extended = dataclasses.replace(plan, layers=(*plan.layers, dataclasses.replace(plan[4], index=5)))
    report = patch_core_attention(model, extended, ReferenceBackend())
    assert report.patched[-1].name == "mtp_layers.0.self_attn.core_attention"
    assert report.patched[-1].layer_index == 5


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_kv_heads": 4}, "num_query_groups_per_partition=2 but plan layer 1 has num_kv_heads=4"),
        ({"v_head_dim": 16}, "v_channels=8"),
        ({"sink": "off-by-one"}, "'learnable' sink"),
        ({"softmax_scale": 0.5}, "softmax_scale"),
    ],
)
def test_plan_module_mismatch_raises(change, match):
    model = build_minifleet("tiny", seed=0)
    plan = plan_from_config(model.config)
    bad = dataclasses.replace(
        plan, layers=tuple(dataclasses.replace(l, **change) if l.index == 1 else l for l in plan)
    )
    with pytest.raises(ValueError, match=match):
        patch_core_attention(model, bad, ReferenceBackend())


def test_unsupported_combination_fails_at_patch_time():
    class NoSinks(ReferenceBackend):
        name = "no-sinks"

        def check_layer(self, layer):
            if layer.sink == "learnable":
                raise ValueError(f"layer {layer.index}: learnable sinks unsupported by {self.name}")

    model = build_minifleet("tiny", seed=0)
    with pytest.raises(ValueError, match="layer 1: learnable sinks unsupported"):
        patch_core_attention(model, plan_from_config(model.config), NoSinks())
    assert not any(isinstance(l, PagedCoreAttention) for l in model.sublayers())


def test_double_patch_bad_arguments_and_holder():
    model, plan, report = patched_tiny()
    assert report.num_patched == 5 and report.backend == "reference"
    with pytest.raises(ValueError, match="already patched"):
        patch_core_attention(model, plan, ReferenceBackend())
    with pytest.raises(TypeError, match="plan must be an AttentionPlan"):
        patch_core_attention(build_minifleet("tiny"), list(plan), ReferenceBackend())
    with pytest.raises(ValueError, match="unknown attention backend"):
        patch_core_attention(build_minifleet("tiny"), plan, "nope")
    with pytest.raises(ValueError, match="patch it"):
        step_holder(build_minifleet("tiny"))
    holder = StepContextHolder()
    other = build_minifleet("tiny")
    patch_core_attention(other, plan, "reference", holder=holder)
    assert step_holder(other) is holder
    assert all(l.holder is holder for l in other.sublayers() if isinstance(l, PagedCoreAttention))
    assert cache_plan(plan, ReferenceBackend()) == plan


def test_mtp_and_empty_head_layers_are_patched_and_keep_parity():
    """MTP layers get plan entries after the decoder layers (PaddleFleet's numbering) and are patched."""
    cfg = {
        "model_type": "minifleet",
        "vocab_size": 64,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "sliding_window": 4,
        "window_attn_skip_freq": [0, 1, 1],
        "num_empty_layers_add_in_head": 1,
        "mtp_num_layers": 1,
    }
    case = build_minifleet_case(cfg, ReferenceBackend(), seed=0)
    assert [(x.index, x.kind) for x in case.plan] == [(0, "full"), (1, "sliding"), (2, "sliding")]
    assert [p.name.split(".")[0] for p in case.patch_report.patched] == ["decoder", "decoder", "mtp"]
    report = run_verify(case, decode_steps=3, progress=False)
    assert report.passed, report.max_abs_logit_diff
