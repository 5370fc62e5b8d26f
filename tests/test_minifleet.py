"""minifleet: its eager core attention against an independent dense check, its structure, MLA shapes.

Each config below carries a hand-written table of what PaddleFleet makes of
it (which layers slide, each kv head's ``window_left``, the sink kind, head
counts and dims), written from PaddleFleet's real code: a sliding layer's
FlashMask rows put key ``j``'s first masked row at ``j + W`` for an int ``W``
and a ``(W, 0)`` tuple alike (W keys including the query: ``window_left = W - 1``);
head-wise ``n = int(r * Hkv)`` slides the last ``n`` heads when ``0 < n < Hkv``,
else all of them. The dense check computes attention from that table with
numpy loops, so neither side reads the other's code.
"""

from __future__ import annotations

import numpy as np
import pytest

paddle = pytest.importorskip(
    "paddle", reason="needs Paddle (the CPU build in CI; the GPU machine has torch only)"
)

from fastdeploy_paddlefleet.minifleet import (  # noqa: E402
    AttnMaskType,
    GPTEmbedding,
    GPTLMHead,
    MultiTokenPredictionLayer,
    TransformerLayer,
    build_minifleet,
    causal_startend_row_indices,
    make_config,
)

BASE = {
    "model_type": "minifleet",
    "vocab_size": 64,
    "hidden_size": 32,
    "ffn_hidden_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 8,
    "rope_theta": 10000.0,
}

# (config overrides, expected per layer: (kv window_left, sink, Hq, Hkv, Dqk, Dv))
CASES = {
    "tiny-preset": (
        "tiny",  # sliding_window (8, 0): 8 keys including the query
        [
            ([None, None], "off-by-one", 4, 2, 16, 16),
            ([7, 7], "learnable", 4, 2, 16, 8),
            ([None, 7], "learnable", 4, 2, 16, 8),  # ratio 0.5 of 2 kv heads: first full, last slides
            ([None, None], "off-by-one", 4, 2, 16, 16),
            ([7, 7], "learnable", 4, 2, 16, 8),
        ],
    ),
    "int-window-skip-2-headwise-quarter": (
        {
            **BASE,
            "num_hidden_layers": 4,
            "sliding_window": 5,  # PaddleFleet int: 5 keys including the query
            "window_attn_skip_freq": 2,  # layers 1 and 3 slide
            "head_wise_swa_ratio": 0.25,  # int(0.25 * 4) = 1 sliding kv head (the last)
            "softmax_type": "vanilla",
            "add_swa_attention_sink_bias": False,
        },
        [
            ([None] * 4, "vanilla", 4, 4, 8, 8),
            ([None, None, None, 4], "vanilla", 4, 4, 8, 8),
            ([None] * 4, "vanilla", 4, 4, 8, 8),
            ([None, None, None, 4], "vanilla", 4, 4, 8, 8),
        ],
    ),
    "every-layer-slides-gqa-full-sinks": (
        {
            **BASE,
            "num_hidden_layers": 2,
            "num_key_value_heads": 1,
            "sliding_window": [2, 0],
            "add_full_attention_sink_bias": True,
            # add_swa_attention_sink_bias defaults to True in PaddleFleet
        },
        [([1], "learnable", 4, 1, 8, 8), ([1], "learnable", 4, 1, 8, 8)],
    ),
    "infinite-window-swa-dims": (
        {
            **BASE,
            "num_hidden_layers": 2,
            "sliding_window": -1,  # infinite: sliding layers (swa dims, swa sink flag) without a window
            "window_attn_skip_freq": [1, 0],
            "swa_num_attention_heads": 2,
            "swa_num_key_value_heads": 2,
            "swa_head_dim": 16,  # swa_v_head_dim falls back to v_head_dim (8), not to swa_head_dim
            "softmax_type": "off-by-one",
        },
        [([None, None], "learnable", 2, 2, 16, 8), ([None] * 4, "off-by-one", 4, 4, 8, 8)],
    ),
    "headwise-ratio-edges-all-heads-slide": (
        {
            **BASE,
            "num_hidden_layers": 3,
            "sliding_window": 4,
            # int(0.1 * 4) = 0 and int(1.0 * 4) = 4 -> every head; 0.0 -> every head
            "head_wise_swa_ratio": [0.1, 1.0, 0.0],
            "add_swa_attention_sink_bias": False,
        },
        [([3] * 4, "vanilla", 4, 4, 8, 8)] * 3,
    ),
    "layer-types-and-use-sliding-window-are-not-read": (
        {
            **BASE,
            "num_hidden_layers": 3,
            "sliding_window": 3,
            "window_attn_skip_freq": 3,  # layers 1, 2 slide
            "layer_types": ["sliding_attention", "full_attention", "full_attention"],
            "use_sliding_window": False,
            "add_swa_attention_sink_bias": False,
        },
        [
            ([None] * 4, "vanilla", 4, 4, 8, 8),
            ([2] * 4, "vanilla", 4, 4, 8, 8),
            ([2] * 4, "vanilla", 4, 4, 8, 8),
        ],
    ),
}


def dense_attention(q, k, v, windows, scale, sink):
    """Loops over heads and queries: q [s, Hq, D], k [s, Hkv, D], v [s, Hkv, Dv] -> [s, Hq * Dv]."""
    s, hq, _ = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    out = np.zeros((s, hq, dv))
    for h in range(hq):
        kh = h // (hq // hkv)
        for i in range(s):
            keys = [j for j in range(i + 1) if windows[kh] is None or i - j <= windows[kh]]
            logits = np.array([scale * q[i, h] @ k[j, kh] for j in keys])
            extra = [] if sink is None else [sink[h]]
            m = max([float(logits.max()), *extra])
            denom = np.exp(logits - m).sum() + sum(np.exp(e - m) for e in extra)
            out[i, h] = sum(np.exp(lg - m) / denom * v[j, kh] for lg, j in zip(logits, keys, strict=True))
    return out.reshape(s, hq * dv)


def core_attentions(model):
    return [layer.self_attn.core_attention for layer in model.decoder.layers]


@pytest.mark.parametrize("case", sorted(CASES))
def test_core_attention_matches_dense_check(case):
    config, expected = CASES[case]
    model = build_minifleet(config, seed=3)
    cores = core_attentions(model)
    assert len(cores) == len(expected)
    rng = np.random.default_rng(0)
    s = 12
    for core, (windows, sink, hq, hkv, d, dv) in zip(cores, expected, strict=True):
        assert (core.num_attention_heads_per_partition, core.num_query_groups_per_partition) == (hq, hkv)
        assert (core.k_channels, core.v_channels) == (d, dv)
        q = rng.standard_normal((1, s, hq, d)).astype("float32")
        k = rng.standard_normal((1, s, hkv, d)).astype("float32")
        v = rng.standard_normal((1, s, hkv, dv)).astype("float32")
        args = (paddle.to_tensor(q), paddle.to_tensor(k), paddle.to_tensor(v), None)
        rows = causal_startend_row_indices(1, s)
        got = core(*args, rows, attn_mask_type=AttnMaskType.causal).numpy()  # the FlashMask path
        if all(w is None for w in windows) and not core.is_swa:  # the eager path gives the same
            np.testing.assert_allclose(core(*args).numpy(), got, atol=2e-6)
        if sink == "vanilla":
            assert core.softmax_offset is None
            sink_values = None
        elif sink == "off-by-one":
            assert core.softmax_offset is not None and "softmax_offset" not in core._parameters
            sink_values = np.zeros(hq)
        else:
            assert "softmax_offset" in core._parameters
            sink_values = core.softmax_offset.numpy()
        want = dense_attention(q[0], k[0], v[0], windows, 1.0 / np.sqrt(d), sink_values)
        assert got.shape == (1, s, hq * dv)
        np.testing.assert_allclose(got[0], want, atol=2e-5, rtol=1e-5)


def test_attention_mask_argument_hides_keys():
    model = build_minifleet({**BASE, "num_hidden_layers": 1}, seed=0)
    core = core_attentions(model)[0]
    rng = np.random.default_rng(1)
    q, k, v = (paddle.to_tensor(rng.standard_normal((1, 6, 4, 8)).astype("float32")) for _ in range(3))
    # PaddleFleet's eager path: a given mask replaces the causal one (True = masked out);
    # causal, and key 0 hidden from everyone but itself
    mask = np.triu(np.ones((6, 6), dtype=bool), 1).reshape(1, 1, 6, 6)
    mask[0, 0, 1:, 0] = True
    got = core(q, k, v, paddle.to_tensor(mask)).numpy()[0]
    qn, kn, vn = q.numpy()[0], k.numpy()[0], v.numpy()[0]
    want = dense_attention(qn[1:], kn[1:], vn[1:], [None] * 4, 1 / np.sqrt(8), None)
    np.testing.assert_allclose(got[1:], want, atol=2e-5)


def test_flashmask_rows_follow_paddle_rules_and_the_enum():
    """The FlashMask path reads the rows as Paddle documents; a string mask type is not causal."""
    model = build_minifleet({**BASE, "num_hidden_layers": 1}, seed=0)
    core = core_attentions(model)[0]
    rng = np.random.default_rng(4)
    q, k, v = (paddle.to_tensor(rng.standard_normal((1, 6, 4, 8)).astype("float32")) for _ in range(3))
    qn, kn, vn = q.numpy()[0], k.numpy()[0], v.numpy()[0]
    scale = 1 / np.sqrt(8)
    # causal, one column: key j masked for rows >= LTS[j]; LTS = 3 for key 0 hides it from rows 3..5
    lts = np.full((1, 1, 6, 1), 6, dtype="int32")
    lts[0, 0, 0, 0] = 3
    got = core(q, k, v, None, paddle.to_tensor(lts), attn_mask_type=AttnMaskType.causal).numpy()[0]
    want = dense_attention_keys(qn[3:], kn, vn, lambda i, j: 1 <= j <= i + 3, scale)  # rows 3..5: keys 1..i
    np.testing.assert_allclose(got[3:], want, atol=2e-5)
    early = dense_attention_keys(qn[:3], kn, vn, lambda i, j: j <= i, scale)  # rows 0..2: keys 0..i
    np.testing.assert_allclose(got[:3], early, atol=2e-5)
    # non-causal, [LTS, UTE]: everything visible except rows >= LTS and rows < UTE of each column
    rows = np.stack([np.full(6, 6), np.zeros(6)], axis=-1).astype("int32").reshape(1, 1, 6, 2)
    bidir = core(q, k, v, None, paddle.to_tensor(rows), attn_mask_type="causal").numpy()[0]
    want = dense_attention_keys(qn, kn, vn, lambda i, j: True, scale)
    np.testing.assert_allclose(bidir, want, atol=2e-5)  # a string is not AttnMaskType.causal


def dense_attention_keys(q, k, v, visible, scale):
    """``q [n, H, D]`` rows ``i = 0..n-1`` over keys ``k [s, H, D]`` where ``visible(i, j)``."""
    n, h, _ = q.shape
    out = np.zeros((n, h, v.shape[2]))
    for hh in range(h):
        for i in range(n):
            keys = [j for j in range(k.shape[0]) if visible(i, j)]
            logits = np.array([scale * q[i, hh] @ k[j, hh] for j in keys])
            w = np.exp(logits - logits.max())
            out[i, hh] = (w / w.sum()) @ v[keys, hh]
    return out.reshape(n, -1)


def test_sliding_layer_refuses_the_eager_path():
    model = build_minifleet("tiny", seed=0)
    core = core_attentions(model)[1]
    q, k, v = paddle.randn([1, 4, 4, 16]), paddle.randn([1, 4, 2, 16]), paddle.randn([1, 4, 2, 8])
    with pytest.raises(ValueError, match="attn_mask_startend_row_indices"):
        core(q, k, v, None)


def test_run_function_passes_dicts():
    model = build_minifleet("tiny", seed=0)
    kinds = [type(layer) for layer in model.run_function]
    assert kinds[0] is GPTEmbedding and kinds[-1] is GPTLMHead
    assert kinds[1:-2] == [TransformerLayer] * 5
    ids = paddle.to_tensor([[1, 2, 3]], dtype="int64")
    x = {
        "input_ids": ids,
        "position_ids": None,
        "attn_mask_startend_row_indices": causal_startend_row_indices(1, 3),
    }
    for layer in model.run_function:
        x = layer(x)
        assert isinstance(x, dict) and x["hidden_states"].shape == [1, 3, 64]
    assert x["logits"].shape == [1, 3, 256]
    assert x["position_ids"].numpy().tolist() == [[0, 1, 2]]
    np.testing.assert_allclose(x["logits"].numpy(), model(ids).numpy(), atol=1e-6)


def test_layer_number_is_zero_based_and_gate_follows_config():
    model = build_minifleet("tiny", seed=0)
    assert [c.layer_number for c in core_attentions(model)] == [0, 1, 2, 3, 4]
    assert all(c.attn_mask_type is AttnMaskType.causal for c in core_attentions(model))
    assert all(layer.self_attn.gate_proj is not None for layer in model.decoder.layers)
    plain = build_minifleet({**BASE, "num_hidden_layers": 1}, seed=0)
    assert plain.decoder.layers[0].self_attn.gate_proj is None


def test_empty_head_layers_and_mtp_layers_follow_paddlefleet_numbering():
    cfg = {
        **BASE,
        "num_hidden_layers": 3,
        "num_empty_layers_add_in_head": 2,
        "mtp_num_layers": 2,
        "sliding_window": 4,
        "window_attn_skip_freq": [0, 1, 0, 1, 0],  # MTP layers are layers 3 and 4 of this list
    }
    model = build_minifleet(cfg, seed=0)
    assert [layer.layer_number for layer in model.decoder.layers] == [2, 3, 4]
    assert [layer.self_attn.is_swa for layer in model.decoder.layers] == [False, True, False]
    mtp = [layer.transformer_layer for layer in model.mtp]
    assert [layer.layer_number for layer in mtp] == [0, 1] and all(layer.is_mtp_layer for layer in mtp)
    assert [layer.self_attn.is_swa for layer in mtp] == [True, False]
    assert sum(isinstance(layer, MultiTokenPredictionLayer) for layer in model.run_function) == 2
    ids = paddle.to_tensor([[1, 2, 3, 4, 5, 6]], dtype="int64")
    x = {
        "input_ids": ids,
        "position_ids": None,
        "attn_mask_startend_row_indices": causal_startend_row_indices(1, 6),
    }
    for layer in model.run_function:
        x = layer(x)
    assert len(x["mtp_hidden_states"]) == 2 and x["mtp_hidden_states"][1].shape == [1, 6, 32]
    with pytest.raises(ValueError, match="window_attn_skip_freq"):  # no entry for the last MTP layer
        build_minifleet({**cfg, "window_attn_skip_freq": [0, 1, 0, 1]})


def test_prefix_logits_do_not_depend_on_later_tokens():
    model = build_minifleet("tiny", seed=1)
    ids = paddle.to_tensor(np.random.default_rng(2).integers(0, 256, (1, 20)), dtype="int64")
    full = model(ids).numpy()
    prefix = model(ids[:, :11]).numpy()
    np.testing.assert_allclose(full[:, :11], prefix, atol=1e-5)


def test_same_seed_same_weights_other_seed_differs():
    a, b, c = (build_minifleet("tiny", seed=s) for s in (5, 5, 6))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert list(sa) == list(sb)
    assert all(np.array_equal(sa[n].numpy(), sb[n].numpy()) for n in sa)
    assert not np.array_equal(sa["lm_head.weight"].numpy(), sc["lm_head.weight"].numpy())
    assert "decoder.layers.1.self_attn.core_attention.softmax_offset" in sa


def test_mla_shapes():
    model = build_minifleet("tiny-mla", seed=0)
    seen = []
    for core in core_attentions(model):
        assert (core.k_channels, core.v_channels) == (24, 16)
        # built without num_key_value_heads (as PaddleFleet's MLA): reports the config's 2 kv heads
        assert (core.num_attention_heads_per_partition, core.num_query_groups_per_partition) == (4, 2)
        assert core.is_swa is False and "softmax_offset" in core._parameters
        assert core.softmax_scale == pytest.approx(24**-0.5)
        core.register_forward_pre_hook(lambda layer, inputs: seen.append([list(t.shape) for t in inputs[:3]]))
    logits = model(paddle.to_tensor([[3, 1, 4, 1, 5, 9, 2]], dtype="int64"))
    assert logits.shape == [1, 7, 256]
    assert seen == [[[1, 7, 4, 24], [1, 7, 4, 24], [1, 7, 4, 16]]] * 3  # K/V: one head per query head
    out = core_attentions(model)[1](
        paddle.randn([2, 5, 4, 24]), paddle.randn([2, 5, 4, 24]), paddle.randn([2, 5, 4, 16]), None
    )
    assert out.shape == [2, 5, 64]


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"hidden_size": None}, "hidden_size"),
        ({"softmax_type": "softmax"}, "softmax_type"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"sliding_window": [4, 2]}, "sliding_window"),
        ({"sliding_window": 4, "window_attn_skip_freq": [0, 1]}, "window_attn_skip_freq"),
        ({"multi_latent_attention": True}, "kv_lora_rank"),
    ],
)
def test_bad_config_fields_are_named(override, field):
    with pytest.raises(ValueError, match=field):
        build_minifleet({**BASE, "num_hidden_layers": 3, **override})


def test_config_sources(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"vocab_size": 8, "hidden_size": 8, "num_layers": 1, "num_attention_heads": 2}')
    cfg = make_config(str(path))
    assert (cfg.num_hidden_layers, cfg.head_dim, cfg.add_swa_attention_sink_bias) == (1, 4, True)
    with pytest.raises(ValueError, match="no-such-preset"):
        make_config("no-such-preset")
    with pytest.raises(TypeError, match="config"):
        make_config(3)
