"""``PaddleFleetForCausalLM``: packed forward vs the host's own dense forward, weights, errors, idle step.

The reference is minifleet's native forward (its own dense eager attention,
no cache, full sequence) on an unpatched twin built with the same seed. The
batch metadata is written here the way FastDeploy's worker lays it out
(``seq_lens_* [bsz, 1]``, idle slots, a padded ``batch_id_per_token``, a flat
cache list ``[k0, v0, k1, v1, ...]``, shuffled physical blocks).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

paddle = pytest.importorskip(
    "paddle", reason="needs Paddle (the CPU build in CI; the GPU machine has torch only)"
)

from fastdeploy_paddlefleet.minifleet import build_minifleet  # noqa: E402
from fastdeploy_paddlefleet.patch import cache_plan  # noqa: E402
from fastdeploy_paddlefleet.plan import plan_from_config  # noqa: E402
from fastdeploy_paddlefleet.presets import load_preset  # noqa: E402
from fastdeploy_paddlefleet.serving.model import (  # noqa: E402
    PaddleFleetForCausalLM,
    batch_meta_from_forward_meta,
    packed_positions,
)

TOL = 1e-4
BLOCK = 4
NUM_BLOCKS = 48
MAX_BLOCKS = 8


def moe_tiny() -> dict:
    cfg = load_preset("tiny")
    cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    return cfg


class FakeWorker:
    """Packs requests into FastDeploy-shaped steps and keeps their paged caches."""

    def __init__(self, wrapper: PaddleFleetForCausalLM, slots: int = 4, seed: int = 0) -> None:
        self.wrapper = wrapper
        self.slots = slots
        plan = cache_plan(wrapper.plan, wrapper.backend)
        self.caches = []
        for layer in plan:
            shape = [NUM_BLOCKS, layer.num_kv_heads, BLOCK]
            self.caches += [
                paddle.full(shape + [layer.qk_head_dim], float("nan")),
                paddle.full(shape + [layer.v_head_dim], float("nan")),
            ]
        self.free = list(np.random.default_rng(seed).permutation(NUM_BLOCKS))
        self.tokens: dict[int, list[int]] = {}
        self.blocks: dict[int, list[int]] = {}

    def step(self, work: dict[int, list[int]]):
        """``work``: slot -> new token ids. Returns (logits [T, V], [(slot, position), ...] per row)."""
        dec, this, enc, ids, rows = [], [], [], [], []
        tables = np.full([self.slots, MAX_BLOCKS], -1, dtype="int32")
        for slot in range(self.slots):
            new = work.get(slot, [])
            cached = len(self.tokens.get(slot, []))
            dec.append(cached)
            this.append(len(new))
            enc.append(len(new) if new and (len(new) > 1 or cached == 0) else 0)
            blocks = self.blocks.setdefault(slot, [])
            while len(blocks) * BLOCK < cached + len(new):
                blocks.append(int(self.free.pop()))
            tables[slot, : len(blocks)] = blocks
            ids += new
            rows += [(slot, cached + i) for i in range(len(new))]
            self.tokens.setdefault(slot, []).extend(new)
        cu = np.concatenate([[0], np.cumsum(this)]).astype("int32")
        batch_id = np.repeat(np.arange(self.slots), this).astype("int32")
        forward_meta = SimpleNamespace(
            seq_lens_encoder=paddle.to_tensor(np.array(enc, "int32")[:, None]),
            seq_lens_decoder=paddle.to_tensor(np.array(dec, "int32")[:, None]),
            seq_lens_this_time=paddle.to_tensor(np.array(this, "int32")),
            cu_seqlens_q=paddle.to_tensor(cu),
            batch_id_per_token=paddle.to_tensor(np.concatenate([batch_id, np.zeros(3, "int32")])),  # padded
            block_tables=paddle.to_tensor(tables),
            caches=self.caches,
            is_zero_size=False,
        )
        inputs = {"ids_remove_padding": paddle.to_tensor(np.array(ids, "int64"))}
        hidden = self.wrapper(inputs, forward_meta)
        return self.wrapper.compute_logits(hidden, forward_meta), rows


def native_logits(model, tokens: list[int]) -> np.ndarray:
    with paddle.no_grad():
        return model(paddle.to_tensor([tokens], dtype="int64"))[0].numpy()


def twins(config, seed: int = 1, backend: str = "reference"):
    native = build_minifleet(config, seed=seed)
    patched = build_minifleet(config, seed=seed)
    wrapper = PaddleFleetForCausalLM.from_model(patched, plan_from_config(patched.config), backend=backend)
    return native, wrapper


def run_schedule(native, wrapper, schedule, seed: int = 0) -> float:
    """Drive ``schedule`` (list of {slot: n_new}) and return the max |paged - native| logit."""
    rng = np.random.default_rng(seed)
    worker = FakeWorker(wrapper, seed=seed)
    worst = 0.0
    for work in schedule:
        logits, rows = worker.step({s: list(rng.integers(0, 256, n)) for s, n in work.items()})
        assert list(logits.shape) == [len(rows), 256]
        logits = logits.numpy()
        for slot in {s for s, _ in rows}:
            ref = native_logits(native, worker.tokens[slot])
            idx = [i for i, (s, _) in enumerate(rows) if s == slot]
            pos = [p for s, p in rows if s == slot]
            worst = max(worst, float(np.abs(logits[idx] - ref[pos]).max()))
    return worst


# chunked prefill, a request joining mid-way, mixed prefill/decode, an idle slot, long enough to slide
SCHEDULE = [
    {0: 6, 1: 9},
    {0: 7, 1: 1, 2: 3},
    {0: 1, 1: 1, 2: 5},
    {0: 1, 2: 1, 3: 10},
    {0: 1, 1: 1, 2: 1, 3: 1},
]


@pytest.mark.parametrize("config", ["tiny", "tiny-mla", moe_tiny()], ids=["tiny", "tiny-mla", "tiny-moe"])
def test_packed_forward_matches_native_dense_forward(config):
    native, wrapper = twins(config)
    assert wrapper.patch_report.num_patched == native.config.num_hidden_layers
    assert run_schedule(native, wrapper, SCHEDULE) <= TOL


def test_parity_check_can_fail_with_wrong_positions(monkeypatch):
    """Sanity of the comparison: wrong RoPE positions break it (not a uniform shift: RoPE is relative)."""
    import fastdeploy_paddlefleet.serving.model as model_mod

    native, wrapper = twins("tiny")
    real = model_mod.packed_positions
    monkeypatch.setattr(model_mod, "packed_positions", lambda meta, n: real(meta, n) * 2)
    assert run_schedule(native, wrapper, SCHEDULE[:2]) > 1e-2


def test_packed_positions_from_fastdeploy_metadata():
    forward_meta = SimpleNamespace(
        seq_lens_encoder=paddle.to_tensor([[3], [0], [0], [2]], dtype="int32"),
        seq_lens_decoder=paddle.to_tensor([[0], [7], [5], [4]], dtype="int32"),
        seq_lens_this_time=paddle.to_tensor([3, 1, 0, 2], dtype="int32"),
        cu_seqlens_q=paddle.to_tensor([0, 3, 4, 4, 6], dtype="int32"),
        batch_id_per_token=paddle.to_tensor([0, 0, 0, 1, 3, 3, 0, 0], dtype="int32"),
        block_tables=paddle.zeros([4, 2], dtype="int32"),
    )
    meta = batch_meta_from_forward_meta(forward_meta, block_size=16, num_tokens=6)
    assert meta.seq_lens_decoder.numpy().tolist() == [0, 7, 5, 4]
    assert meta.num_tokens == 6 and meta.block_size == 16
    # no host copy of the metadata (CUDA graphs): the launch bounds stay unknown with a prefill ...
    assert (meta.max_seq_len_this_time, meta.max_context_len) == (None, None)
    assert packed_positions(meta, 6).numpy().tolist() == [0, 1, 2, 7, 4, 5]
    # ... and a decode-only step (FastDeploy's host flag exist_prefill=False) has one token per request
    forward_meta.exist_prefill = False
    meta = batch_meta_from_forward_meta(forward_meta, block_size=16, num_tokens=6)
    assert (meta.max_seq_len_this_time, meta.max_context_len) == (1, None)


def _meta(**overrides):
    base = dict(
        seq_lens_encoder=paddle.to_tensor([2], dtype="int32"),
        seq_lens_decoder=paddle.to_tensor([0], dtype="int32"),
        seq_lens_this_time=paddle.to_tensor([2], dtype="int32"),
        cu_seqlens_q=paddle.to_tensor([0, 2], dtype="int32"),
        batch_id_per_token=paddle.to_tensor([0, 0], dtype="int32"),
        block_tables=paddle.to_tensor([[0]], dtype="int32"),
        caches=None,
    )
    base.update(overrides)
    return SimpleNamespace(**base)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"cu_seqlens_q": paddle.to_tensor([0, 1, 2], dtype="int32")}, "cu_seqlens_q"),
        ({"seq_lens_decoder": paddle.to_tensor([0, 0], dtype="int32")}, "seq_lens_decoder"),
        ({"batch_id_per_token": paddle.to_tensor([0], dtype="int32")}, "batch_id_per_token"),
        ({"block_tables": None}, "block_tables"),
        ({"seq_lens_this_time": None}, "seq_lens_this_time"),
    ],
)
def test_bad_forward_meta_raises(overrides, match):
    with pytest.raises(ValueError, match=match):
        batch_meta_from_forward_meta(_meta(**overrides), block_size=4, num_tokens=2)


def test_block_size_must_be_known():
    with pytest.raises(ValueError, match="block_size"):
        batch_meta_from_forward_meta(_meta(), num_tokens=2)


def test_bad_inputs_and_caches_raise():
    _, wrapper = twins("tiny")
    ids = {"ids_remove_padding": paddle.to_tensor([1, 2], dtype="int64")}
    with pytest.raises(ValueError, match="ids_remove_padding"):
        wrapper({}, _meta())
    with pytest.raises(ValueError, match="ids_remove_padding"):
        wrapper({"ids_remove_padding": paddle.zeros([2, 2], dtype="int64")}, _meta())
    with pytest.raises(ValueError, match="caches"):  # none given
        wrapper(ids, _meta(block_size=4))
    key = paddle.zeros([2, 2, 4, 16])
    with pytest.raises(ValueError, match="pairs"):  # odd flat list
        wrapper(ids, _meta(caches=[key, key, key]))
    with pytest.raises(ValueError, match="plan has 5 layers"):  # too few layers
        wrapper(ids, _meta(caches=[key, key]))
    with pytest.raises(TypeError, match="plan"):
        PaddleFleetForCausalLM.from_model(build_minifleet("tiny"), plan=None, backend="reference")


def test_weights_round_trip_through_load_weights_and_set_state_dict():
    native, source = twins("tiny", seed=1)
    _, target = twins("tiny", seed=2)
    names = list(source.state_dict())
    sinks = [n for n in names if n.endswith("core_attention.softmax_offset")]
    assert sinks, "learnable sinks must stay under ...core_attention.softmax_offset"
    assert run_schedule(native, target, SCHEDULE[:2]) > 1e-2  # different seeds differ

    missing = target.load_weights((name, t.numpy()) for name, t in source.state_dict().items())
    assert missing == []
    assert run_schedule(native, target, SCHEDULE[:3]) <= TOL

    # the inner model's own names (no "model." prefix) load too; the sink lands where the adapter reads it
    _, third = twins("tiny", seed=3)
    third.set_state_dict(source.model.state_dict())
    assert run_schedule(native, third, SCHEDULE[:2]) <= TOL
    sink_name = sinks[0][len("model.") :]
    bumped = source.model.state_dict()[sink_name].numpy() + 3.0
    third.set_state_dict({sink_name: bumped})
    assert run_schedule(native, third, SCHEDULE[:2]) > 1e-3


def test_bad_weights_raise():
    _, wrapper = twins("tiny")
    with pytest.raises(ValueError, match="not in the model"):
        wrapper.set_state_dict({"decoder.layers.0.nope.weight": np.zeros([1], "float32")})
    name = "model.embedding.word_embeddings.weight"
    with pytest.raises(ValueError, match="shape"):
        wrapper.set_state_dict({name: np.zeros([3, 3], "float32")})


def _write_model_dir(tmp_path, config: dict):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return SimpleNamespace(
        model_config=SimpleNamespace(model=str(tmp_path), dtype="float32", seed=1, ori_vocab_size=250),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, tensor_parallel_rank=0, expert_parallel_size=1
        ),
        cache_config=SimpleNamespace(block_size=BLOCK),
    )


def test_fastdeploy_constructor_without_paddlefleet_names_the_package(tmp_path):
    import importlib.util

    assert importlib.util.find_spec("paddlefleet") is None  # this machine cannot install it
    fd_config = _write_model_dir(
        tmp_path,
        {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64},
    )
    with pytest.raises(ImportError, match="paddlefleet") as info:
        PaddleFleetForCausalLM(fd_config)
    assert info.value.name == "paddlefleet"


def test_fastdeploy_constructor_builds_embedded_minifleet(tmp_path, monkeypatch):
    monkeypatch.setenv("FDFLEET_BACKEND", "reference")
    fd_config = _write_model_dir(tmp_path, load_preset("tiny"))
    wrapper = PaddleFleetForCausalLM(fd_config)
    assert PaddleFleetForCausalLM.name() == "PaddleFleetForCausalLM"
    assert wrapper.backend.name == "reference" and wrapper.block_size == BLOCK
    native = build_minifleet(load_preset("tiny"), seed=1)
    worker = FakeWorker(wrapper)
    logits, rows = worker.step({0: [5, 6, 7, 8, 9]})
    ref = native_logits(native, worker.tokens[0])
    assert np.abs(logits.numpy()[:, :250] - ref[:, :250]).max() <= TOL
    assert np.isneginf(logits.numpy()[:, 250:]).all()  # padded vocabulary never sampled


def test_idle_step_without_expert_parallelism_returns_empty_at_once():
    _, wrapper = twins(moe_tiny())
    assert wrapper.expert_parallel is False
    calls = []
    for layer in wrapper.model.sublayers():
        if type(layer).__name__ == "MoEMLP":
            layer.register_forward_post_hook(lambda *a: calls.append(1))
    out = wrapper(
        {"ids_remove_padding": paddle.zeros([0], dtype="int64")}, SimpleNamespace(is_zero_size=True)
    )
    assert list(out.shape) == [0, 64] and calls == []


def test_idle_step_with_expert_parallelism_runs_every_layer_on_scratch():
    _, wrapper = twins(moe_tiny())
    wrapper.expert_parallel = True  # as if ep > 1 (the two-process test exercises the real exchange)
    calls = []
    for layer in wrapper.model.sublayers():
        if type(layer).__name__ == "MoEMLP":
            layer.register_forward_post_hook(lambda layer, inp, out: calls.append(list(out.shape)))
    worker = FakeWorker(wrapper)
    before = [c.numpy().copy() for c in worker.caches]
    forward_meta = SimpleNamespace(is_zero_size=True, caches=worker.caches)
    out = wrapper({"ids_remove_padding": paddle.zeros([0], dtype="int64")}, forward_meta)
    assert list(out.shape) == [0, 64]
    assert calls == [[1, 1, 64]] * 5  # one fake token through each of the 5 MoE layers
    for b, c in zip(before, worker.caches, strict=True):  # the real cache is untouched
        np.testing.assert_array_equal(np.isnan(b), np.isnan(c.numpy()))
    logits = wrapper.compute_logits(out)
    assert list(logits.shape) == [0, 256]


def test_served_model_dir_config_is_size_capped_before_reading(tmp_path):
    """FastDeploy's model directory goes through the plan's capped reader: a multi-MiB config.json is
    refused by file name, without reading it (a sparse file: no memory or time spent)."""
    from types import SimpleNamespace

    from fastdeploy_paddlefleet.plan.fields import MAX_CONFIG_BYTES
    from fastdeploy_paddlefleet.serving.build import build_from_fd_config

    config = tmp_path / "config.json"
    with open(config, "wb") as f:
        f.truncate(MAX_CONFIG_BYTES + 1)
    fd_config = SimpleNamespace(model_config=SimpleNamespace(model=str(tmp_path)), parallel_config=None)
    with pytest.raises(ValueError, match="config.json.*bytes"):
        build_from_fd_config(fd_config)
