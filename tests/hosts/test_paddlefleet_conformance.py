"""Conformance with PaddleFleet's REAL core attention (tests/hosts/_paddlefleet_host.py says what is real).

Each case builds a tiny PaddleFleet-shaped model twice around the real
``DotProductAttention`` (same weights), patches one with ``patch_core_attention``
and the plan ``plan.plan_from_config`` reads from the model's config, and runs
``runner.verify.run_verify``: three requests (prompts longer than every window)
in chunked prefill (chunks of 5) and 16 greedy decode steps in mixed batches on
a shuffled paged KV cache, every position compared with the real module's own
forward over the whole sequence. The real module runs its FlashMask branch (fed
causal start/end rows, the production path; the only one sliding layers take)
and, for full-attention models, also its eager branch (no rows,
``_attn_implementation="eager"``). fp32 throughout.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

paddle = pytest.importorskip(
    "paddle", reason="needs Paddle (the CPU build in CI; the GPU machine has torch only)"
)

from _paddlefleet_host import (  # noqa: E402
    STAND_INS,
    build_model,
    flashmask_attention,
    fleet_config,
    host_or_skip,
    load_host,
)

from fastdeploy_paddlefleet.patch import patch_core_attention, unpatch_core_attention  # noqa: E402
from fastdeploy_paddlefleet.plan import plan_from_config  # noqa: E402
from fastdeploy_paddlefleet.runner.fleet_case import fleet_case  # noqa: E402
from fastdeploy_paddlefleet.runner.verify import run_verify  # noqa: E402

TOL = 1e-4
DECODE_STEPS = 16

# name -> (config fields, expected plan (kind, window_left, sliding kv heads) per layer, branches)
CASES = {
    "gqa-full": (
        {"num_key_value_heads": 2},
        [("full", None, None)] * 2,
        ("flashmask", "eager", "eager-baddbmm"),
    ),
    "sinks-learnable-full": (
        {"num_key_value_heads": 2, "add_full_attention_sink_bias": True},
        [("full", None, None)] * 2,
        ("flashmask", "eager"),
    ),
    "sinks-off-by-one-full": (
        {"num_key_value_heads": 1, "softmax_type": "off-by-one"},
        [("full", None, None)] * 2,
        ("flashmask", "eager"),
    ),
    "mla-qk-ne-v": (
        {
            "multi_latent_attention": True,
            "num_key_value_heads": 1,  # the module reports 1; K/V carry 4 heads
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 4,
            "v_head_dim": 6,
            "add_full_attention_sink_bias": True,
            "sliding_window": 4,  # MLA layers never slide in PaddleFleet
            "rotary_scaling_factor": 4.0,
            "mscale_all_dim": 1.0,
        },
        [("full", None, None)] * 2,
        ("flashmask", "eager"),
    ),
    "sliding-int-window-int-skip": (
        {
            "num_hidden_layers": 3,
            "num_key_value_heads": 2,
            "sliding_window": 4,
            "window_attn_skip_freq": 2,
            "add_swa_attention_sink_bias": False,
        },
        [("full", None, None), ("sliding", 3, (0, 2)), ("full", None, None)],
        ("flashmask",),
    ),
    "sliding-tuple-window-list-skip-own-kv-heads": (
        {
            "num_hidden_layers": 3,
            "num_key_value_heads": 2,
            "sliding_window": (5, 0),
            "window_attn_skip_freq": [0, 1, 1],
            "swa_num_key_value_heads": 1,
            "swa_head_dim": 16,  # swa_v_head_dim falls back to v_head_dim (8)
        },
        [("full", None, None), ("sliding", 4, (0, 1)), ("sliding", 4, (0, 1))],
        ("flashmask",),
    ),
    "sinks-learnable-full-and-sliding": (
        {
            "num_key_value_heads": 2,
            "sliding_window": 3,
            "window_attn_skip_freq": [1, 0],
            "add_full_attention_sink_bias": True,
            "add_swa_attention_sink_bias": True,
        },
        [("sliding", 2, (0, 2)), ("full", None, None)],
        ("flashmask",),
    ),
    "sinks-off-by-one-full-and-sliding": (
        {
            "num_key_value_heads": 2,
            "sliding_window": (4, 0),
            "window_attn_skip_freq": [0, 1],
            "softmax_type": "off-by-one",
            "add_swa_attention_sink_bias": False,
        },
        [("full", None, None), ("sliding", 3, (0, 2))],
        ("flashmask",),
    ),
    "headwise-half": (
        {"num_key_value_heads": 4, "sliding_window": 4, "head_wise_swa_ratio": 0.5},
        [("headwise", 3, (2, 4))] * 2,
        ("flashmask",),
    ),
    "headwise-quarter": (
        {"num_key_value_heads": 4, "sliding_window": 4, "head_wise_swa_ratio": 0.25},
        [("headwise", 3, (3, 4))] * 2,
        ("flashmask",),
    ),
    "headwise-zero-all-heads": (
        {"num_key_value_heads": 4, "sliding_window": 4, "head_wise_swa_ratio": 0.0},
        [("sliding", 3, (0, 4))] * 2,
        ("flashmask",),
    ),
    "headwise-too-small-all-heads": (
        {"num_key_value_heads": 4, "sliding_window": 4, "head_wise_swa_ratio": 0.2},  # int(0.8) = 0
        [("sliding", 3, (0, 4))] * 2,
        ("flashmask",),
    ),
    "headwise-one-all-heads": (
        {"num_key_value_heads": 4, "sliding_window": 4, "head_wise_swa_ratio": 1.0},
        [("sliding", 3, (0, 4))] * 2,
        ("flashmask",),
    ),
    "layer-types-not-read": (
        {
            "num_hidden_layers": 3,
            "num_key_value_heads": 2,
            "sliding_window": 4,
            "window_attn_skip_freq": 3,  # layers 1, 2 slide
            "layer_types": ["sliding_attention", "full_attention", "full_attention"],
            "use_sliding_window": False,
        },
        [("full", None, None), ("sliding", 3, (0, 2)), ("sliding", 3, (0, 2))],
        ("flashmask",),
    ),
    "empty-head-layer-and-mtp": (
        {
            "num_key_value_heads": 2,
            "sliding_window": 4,
            "window_attn_skip_freq": [0, 1, 1],  # the MTP layer is layer 2
            "num_empty_layers_add_in_head": 1,
            "mtp_num_layers": 1,
        },
        [("full", None, None), ("sliding", 3, (0, 2)), ("sliding", 3, (0, 2))],
        ("flashmask",),
    ),
}

RUNS = [(name, branch) for name, (_, _, branches) in CASES.items() for branch in branches]


@pytest.fixture(scope="module")
def host():
    return load_host(host_or_skip())


def build_case(hm, fields, branch, plan_transform=None):
    """``branch``: ``flashmask`` (rows fed), ``eager`` (no rows, ``_attn_implementation="eager"``:
    its accuracy-compatible QK), ``eager-baddbmm`` (no rows, TransformerConfig's default
    implementation: fp32 falls through to the same eager branch with ``paddle.baddbmm``)."""
    config = fleet_config(**fields)
    native_path = "flashmask" if branch == "flashmask" else "eager"
    if branch == "eager":
        config._attn_implementation = "eager"
    elif branch == "eager-baddbmm":
        config._attn_implementation = "default"
    native, paged = build_model(hm, config), build_model(hm, config)
    plan = plan_from_config(paged.config)
    if plan_transform is not None:
        plan = plan_transform(plan)
    return fleet_case(
        f"paddlefleet-real:{native_path}", native, paged, plan, "reference", native_path=native_path
    )


def count_calls(monkeypatch, hm):
    """Count the real module's FlashMask calls and eager softmax calls."""
    calls = {"flashmask": 0, "eager": 0}
    dpa_globals = hm.DotProductAttention.forward.__globals__

    def counted(*args, **kwargs):
        calls["flashmask"] += 1
        return flashmask_attention(*args, **kwargs)

    monkeypatch.setitem(dpa_globals, "flashmask_attention", counted)
    real_forward = hm.fused_softmax.FusedScaleMaskSoftmax.forward

    def eager(self, *args, **kwargs):
        calls["eager"] += 1
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(hm.fused_softmax.FusedScaleMaskSoftmax, "forward", eager)
    return calls


@pytest.mark.parametrize(("name", "branch"), RUNS, ids=[f"{n}-{b}" for n, b in RUNS])
def test_patched_model_matches_the_real_core_attention(host, monkeypatch, name, branch):
    fields, expected, _ = CASES[name]
    calls = count_calls(monkeypatch, host)
    case = build_case(host, fields, branch)
    got = [(x.kind, x.window_left, x.sliding_kv_heads) for x in case.plan]
    assert got == expected
    assert case.patch_report.num_patched == len(expected)
    report = run_verify(case, decode_steps=DECODE_STEPS, chunk_size=5, block_size=4, progress=False)
    widest = max((x.window_left + 1 for x in case.plan if x.window_left is not None), default=0)
    assert min(r["prompt_len"] for r in report.requests) > widest
    assert report.max_abs_logit_diff <= TOL, report.max_abs_logit_diff
    assert report.greedy_agreement == 1.0
    assert sum(s.greedy_total for s in report.steps) >= 3 * (DECODE_STEPS + 1)
    path = "flashmask" if branch == "flashmask" else "eager"
    assert calls[path] > 0 and calls["eager" if path == "flashmask" else "flashmask"] == 0


@pytest.mark.parametrize("shift", [1, -1])
def test_a_window_off_by_one_fails(host, shift):
    """The plan reading W as W + 1 keys (the old ``window_left = W``), or W - 1, breaks parity."""

    def shifted(plan):
        layers = tuple(
            dataclasses.replace(x, window_left=x.window_left + shift) if x.window_left is not None else x
            for x in plan
        )
        return dataclasses.replace(plan, layers=layers)

    for name in ("sliding-int-window-int-skip", "sliding-tuple-window-list-skip-own-kv-heads"):
        case = build_case(host, CASES[name][0], "flashmask", plan_transform=shifted)
        report = run_verify(case, decode_steps=DECODE_STEPS, chunk_size=5, block_size=4, progress=False)
        assert report.max_abs_logit_diff > 1e-2, (name, report.max_abs_logit_diff)
        assert not report.passed


def test_real_sliding_layers_refuse_the_eager_branch(host):
    config = fleet_config(num_key_value_heads=2, sliding_window=4)
    model = build_model(host, config)
    core = model.layers[0].self_attn.core_attention
    q, k, v = paddle.randn([1, 6, 4, 8]), paddle.randn([1, 6, 2, 8]), paddle.randn([1, 6, 2, 8])
    with pytest.raises(AssertionError, match="SWA"):
        core(q, k, v, None, None, attn_mask_type=host.AttnMaskType.causal)


def test_real_flashmask_window_is_w_keys_including_the_query(host):
    """``startend_row_indices_add_sliding_window``: key j's first masked row is j + W (int and tuple),
    so a query sees W keys including itself; head-wise ratio 0.5 keeps the first half of the heads full."""
    add = host.utils.startend_row_indices_add_sliding_window
    rows = paddle.full([1, 1, 8, 1], 8, dtype="int32")
    for window in (3, (3, 0)):
        out = add(rows, window, 0.0, 2).numpy()
        assert out.shape == (1, 2, 8, 1)
        assert out[0, :, :, 0].tolist() == [[3, 4, 5, 6, 7, 8, 8, 8]] * 2
    half = add(rows, 3, 0.5, 2).numpy()[0, :, :, 0]
    assert half[0].tolist() == [8] * 8 and half[1].tolist() == [3, 4, 5, 6, 7, 8, 8, 8]
    # its eager helper (never reached by sliding layers) would allow one key more
    eager = host.utils.get_sliding_window_causal_mask(8, 8, 3).numpy()
    assert (~eager[7]).sum() == 4


def test_real_mla_core_reports_config_kv_heads_and_patches(host):
    fields = CASES["mla-qk-ne-v"][0]
    model = build_model(host, fleet_config(**fields))
    core = model.layers[0].self_attn.core_attention
    assert core.num_query_groups_per_partition == 1 and core.is_swa is False
    assert (core.k_channels, core.v_channels) == (12, 6)
    plan = plan_from_config(model.config)
    assert plan[0].num_kv_heads == 4 and plan[0].softmax_scale == pytest.approx(core.softmax_scale)
    report = patch_core_attention(model, plan, "reference")
    assert report.num_patched == 2
    assert unpatch_core_attention(model) == 2


def test_flashmask_stand_in_matches_paddle_documented_example():
    """Paddle's flashmask_attention example: rows [8]*10 for head 0, [5]*10 for head 1, causal:
    head 1's rows 5.. see nothing (zeros), head 0's rows 8.. likewise; the rest is causal attention."""
    rng = np.random.default_rng(0)
    q, k, v = (paddle.to_tensor(rng.random((1, 10, 2, 8)).astype("float32")) for _ in range(3))
    rows = paddle.to_tensor([8] * 10 + [5] * 10, dtype="int32").reshape([1, 2, 10, 1])
    out = flashmask_attention(q, k, v, rows, causal=True).numpy()[0]
    assert np.all(out[5:, 1] == 0) and np.all(out[8:, 0] == 0)
    qn, kn, vn = q.numpy()[0], k.numpy()[0], v.numpy()[0]
    for i, h in ((3, 0), (4, 1), (7, 0)):
        s = qn[i, h] @ kn[: i + 1, h].T / np.sqrt(8)
        p = np.exp(s - s.max())
        np.testing.assert_allclose(out[i, h], (p / p.sum()) @ vn[: i + 1, h], atol=1e-6)


def test_stand_ins_are_listed_with_a_reason(host):
    assert all(reason for reason in STAND_INS.values())
    assert all(f.startswith(str(host.host.root)) for f in host.files)
    import sys

    # the stand-ins were only in sys.modules while the real files were imported
    facade = sys.modules.get("paddlefleet_ops.flash_mask_facade")
    assert getattr(facade, "flashmask_attention", None) is not flashmask_attention


@pytest.mark.parametrize(
    ("ratio", "sliding_local"),
    [(0.5, (1, 2)), (0.25, (0, 2))],  # per rank: int(0.5 * 2) = 1 head; int(0.25 * 2) = 0 -> every head
)
def test_tensor_parallel_rank_matches_the_real_module(host, ratio, sliding_local):
    """At TP 2 the real module masks with its rank's own kv heads (``value.shape[2]``): the plan's
    per-rank head-wise split matches it, rank by rank (core attention level; the adapter uses the
    module's own per-rank sink parameter)."""
    from _paddlefleet_host import Bf16Label

    from fastdeploy_paddlefleet.adapter import PagedCoreAttention, StepContext, StepContextHolder
    from fastdeploy_paddlefleet.backends.reference import ReferenceBackend
    from fastdeploy_paddlefleet.runner.batch import PagedKVState, allocate_kv_caches

    class TP2:
        class tp:  # noqa: N801 - PaddleFleet's attribute name
            world_size = 2

    config = fleet_config(
        num_attention_heads=8, num_key_value_heads=4, head_dim=8, sliding_window=5, head_wise_swa_ratio=ratio
    )
    config.add_swa_attention_sink_bias = True
    s = 11
    rng = np.random.default_rng(7)
    for rank in (0, 1):
        core = host.DotProductAttention(
            config=config,
            layer_number=0,
            attn_mask_type=host.AttnMaskType.causal,
            attention_type="self",
            is_swa=True,
            k_channels=8,
            v_channels=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            pg_collection=TP2(),
        )
        core.eval()
        core.softmax_offset.set_value(paddle.to_tensor(rng.standard_normal(4).astype("float32")))
        plan = plan_from_config(config, tp_size=2, tp_rank=rank)
        layer = plan[0]
        assert (layer.num_q_heads, layer.num_kv_heads, layer.sliding_kv_heads) == (4, 2, sliding_local)
        q = paddle.to_tensor(rng.standard_normal((1, s, 4, 8)).astype("float32"))
        k = paddle.to_tensor(rng.standard_normal((1, s, 2, 8)).astype("float32"))
        v = paddle.to_tensor(rng.standard_normal((1, s, 2, 8)).astype("float32"))
        rows = paddle.full([1, 1, s, 1], s, dtype="int32")
        with paddle.no_grad():
            want = core(Bf16Label(q), k, v, None, rows, attn_mask_type=host.AttnMaskType.causal).numpy()
            holder = StepContextHolder()
            adapter = PagedCoreAttention(core, layer, ReferenceBackend(), holder)
            state = PagedKVState(8, 4, 8, shuffle_seed=rank)
            meta = state.schedule([("r", s)])
            ctx = StepContext(meta, allocate_kv_caches(plan, 8, 4), state.positions(meta))
            with holder.step(ctx):
                got = adapter(q, k, v, None, None, attn_mask_type=host.AttnMaskType.causal).numpy()
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"rank {rank}")
