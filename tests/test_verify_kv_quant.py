"""``fdfleet verify --kv-cache-quant``: the quantized paged path against the unquantized one.

Independent facts, never the code's own output:

* the quantized run's logits equal those of a separate run on an *unquantized* cache whose every
  K / V was quantized and dequantized on the way in by a numpy transcription of FastDeploy's
  ``block_wise_fp8`` rule written here (``docs/kv_quant.md``: ``448 / max|x|`` per token and kv head,
  the product rounded to an integer ties-to-even, then to the e4m3 grid ties-to-even; the grid
  from its bit fields);
* top-1 agreement and the max / mean logit error, recomputed with numpy from that run and a plain
  (unquantized) verify run, equal the report's;
* a broken dequantization (scales off by 2, NaN) fails the verdict and the exit status;
* the static formats' calibration: scales ``max |x| / bound`` per kv head / channel of a cache
  whose values are set here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("paddle", reason="verify runs paddle models")

from fastdeploy_paddlefleet.backends.reference import ReferenceBackend  # noqa: E402
from fastdeploy_paddlefleet.cli import main  # noqa: E402
from fastdeploy_paddlefleet.runner.fleet_case import build_minifleet_case  # noqa: E402
from fastdeploy_paddlefleet.runner.verify import run_verify  # noqa: E402

QUANT_KEYS = {
    "type",
    "passed",
    "positions",
    "top1_agreement",
    "greedy_top1_agreement",
    "max_abs_logit_error",
    "mean_abs_logit_error",
    "nonfinite_positions",
    "compared_with",
}


def e4m3_grid() -> tuple[np.ndarray, np.ndarray]:
    """Non-negative finite e4m3fn values (sorted) and their mantissa bits, from the bit fields."""
    vals, mans = [0.0], [0]
    for m in range(1, 8):  # subnormals: m/8 * 2^-6
        vals.append(m / 8 * 2.0**-6)
        mans.append(m)
    for e in range(1, 16):
        for m in range(8):
            if e == 15 and m == 7:  # 0x7F: NaN
                continue
            vals.append(2.0 ** (e - 7) * (1 + m / 8))
            mans.append(m)
    return np.asarray(vals), np.asarray(mans)


GRID, MANT = e4m3_grid()


def to_e4m3(q: np.ndarray) -> np.ndarray:
    """Integers ``q`` in [-448, 448] to the nearest e4m3fn value, ties to the even mantissa."""
    a = np.abs(q).astype(np.float64)
    hi = np.clip(np.searchsorted(GRID, a), 0, len(GRID) - 1)
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = a - GRID[lo], GRID[hi] - a
    pick = np.where((d_lo < d_hi) | ((d_lo == d_hi) & (MANT[lo] % 2 == 0)), lo, hi)
    return np.sign(q) * GRID[pick]


def fake_block_wise_fp8(x: np.ndarray) -> np.ndarray:
    """fp32 ``x [T, H, D]`` -> what a block_wise_fp8 cache reads back: per token-head
    ``c = fp32(448 / max|x|)``, code ``e4m3(rint(fp32(c * x)))``, value ``code * fp32(1 / c)``."""
    x = x.astype(np.float32)
    m = np.abs(x).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        c = np.float32(448.0) / m
    ok = np.isfinite(c)
    c = np.where(ok, c, np.float32(1.0)).astype(np.float32)
    y = (c * x).astype(np.float32)
    q = np.clip(np.rint(y), -448, 448)
    s = (np.float32(1.0) / c).astype(np.float32)
    out = (to_e4m3(q).astype(np.float32) * s).astype(np.float32)
    return np.where(ok, out, np.float32(0.0))


class FakeQuantReference(ReferenceBackend):
    """The reference backend on an unquantized cache, fed K / V quantized-dequantized by numpy."""

    def forward(self, q, k, v, layer, meta, kv_cache, sinks=None):
        import paddle

        k = paddle.to_tensor(fake_block_wise_fp8(k.numpy()))
        v = paddle.to_tensor(fake_block_wise_fp8(v.numpy()))
        return super().forward(q, k, v, layer, meta, kv_cache, sinks)


def test_e4m3_transcription_matches_ml_dtypes():
    ml = pytest.importorskip("ml_dtypes")
    q = np.arange(-448, 449, dtype=np.float32)
    want = q.astype(ml.float8_e4m3fn).astype(np.float32)  # round to nearest even
    np.testing.assert_array_equal(to_e4m3(q), want)


@pytest.mark.parametrize("preset", ["tiny", "tiny-mla"])
def test_quantized_run_equals_a_numpy_quantize_dequantize_run(preset):
    kw = dict(decode_steps=3, progress=False, seed=2)  # a seed whose greedy picks survive quantization
    r = run_verify(build_minifleet_case(preset, "reference"), kv_cache_quant="block_wise_fp8", **kw)
    plain = run_verify(build_minifleet_case(preset, "reference"), **kw)
    fake = run_verify(build_minifleet_case(preset, FakeQuantReference()), tolerance=1e30, **kw)
    assert r.paged_passed and plain.passed
    assert r.requests == plain.requests  # the quantized run changes nothing in the first run
    # the fake run decodes greedily from its own (quantized) logits: the same tokens only where no pick
    # flips (true at this seed), so that both runs see the same inputs
    assert fake.requests == r.requests
    assert len(r.quant_step_logits) == len(fake.step_logits) == len(plain.step_logits)
    for got, want in zip(r.quant_step_logits, fake.step_logits, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    # the figures, recomputed from the two independent runs
    ref = np.concatenate(plain.step_logits).astype(np.float64)
    got = np.concatenate(fake.step_logits).astype(np.float64)
    top1 = float((ref.argmax(1) == got.argmax(1)).mean())
    d = r.to_dict()["kv_cache_quant"]
    assert d["type"] == "block_wise_fp8" and d["positions"] == ref.shape[0]
    assert d["top1_agreement"] == pytest.approx(top1, abs=1e-12)
    assert d["max_abs_logit_error"] == pytest.approx(np.abs(got - ref).max(), abs=1e-4)
    assert d["mean_abs_logit_error"] == pytest.approx(np.abs(got - ref).mean(), rel=1e-3)
    assert d["max_abs_logit_error"] > 0  # quantization did something
    assert d["passed"] and r.passed


def verify_json(capsys, *args):
    code = main(["verify", "--json", "--backend", "reference", *args])
    return code, json.loads(capsys.readouterr().out)


def test_cli_json_and_text(capsys):
    code, rep = verify_json(capsys, "--steps", "2", "--kv-cache-quant", "block_wise_fp8")
    assert code == 0 and rep["passed"]
    q = rep["kv_cache_quant"]
    assert QUANT_KEYS <= set(q) and q["type"] == "block_wise_fp8" and q["calibration"] is None
    assert q["positions"] == sum(s["num_tokens"] for s in rep["per_step"])
    assert all("quant_max_abs_logit_error" in s for s in rep["per_step"])
    assert main(["verify", "--backend", "reference", "--steps", "1", "--kv-cache-quant", "cache_int8"]) == 0
    out = capsys.readouterr().out
    assert "int8 KV cache vs the same paged run on a float32 cache, same tokens" in out
    assert "top-1 agreement" in out and "static scales: max |K|, |V| per channel" in out
    code, rep = verify_json(capsys, "--steps", "1")
    assert code == 0 and rep["kv_cache_quant"] is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kv-cache-quant", "int4_zp"], "int4_zp"),
        (["--kv-cache-quant", "fp4"], "unknown"),
        (["--quant-min-top1", "0.5"], "--quant-min-top1 needs --kv-cache-quant"),
        (["--kv-cache-quant", "block_wise_fp8", "--quant-min-top1", "2"], "--quant-min-top1"),
    ],
)
def test_cli_bad_quant_arguments_exit_2(capsys, args, message):
    try:  # argparse-level refusals exit through SystemExit(2), the others return 2
        code = main(["verify", "--backend", "reference", *args])
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize(("factor", "why"), [(2.0, "top-1 agreement"), (float("nan"), "non-finite")])
def test_broken_dequantization_fails(capsys, monkeypatch, factor, why):
    from fastdeploy_paddlefleet.backends import reference

    orig = reference._dequantize
    monkeypatch.setattr(reference, "_dequantize", lambda codes, fmt: orig(codes, fmt) * factor)
    code, rep = verify_json(capsys, "--steps", "2", "--kv-cache-quant", "block_wise_fp8")
    q = rep["kv_cache_quant"]
    assert code == 1 and not rep["passed"] and not q["passed"]
    assert any(why in f for f in q["failures"]), q["failures"]
    assert rep["max_abs_logit_diff"] <= 1e-4  # the unquantized run itself still agrees


def test_static_calibration_scales():
    import paddle

    from fastdeploy_paddlefleet.kvcache.quant import kv_cache_quant
    from fastdeploy_paddlefleet.minifleet.config import load_raw_config
    from fastdeploy_paddlefleet.plan import plan_from_config
    from fastdeploy_paddlefleet.runner.kv_quant_compare import KVCalibration

    layer = plan_from_config(load_raw_config("tiny")).layers[1]  # 2 kv heads, K 16, V 8
    assert (layer.num_kv_heads, layer.qk_head_dim, layer.v_head_dim) == (2, 16, 8)
    rng = np.random.default_rng(0)
    key = rng.normal(size=(5, 2, 4, 16)).astype(np.float32)
    val = rng.normal(size=(5, 2, 4, 8)).astype(np.float32)
    key[1, 0, 2, 1] = -9.0  # head 0's largest |K|, channel 1
    val[:, 1] = 0.0  # head 1's values never above 0
    val[3, 1, 0, 0] = np.nan  # a poisoned slot: ignored
    cal = KVCalibration([layer])
    caches = {1: (paddle.to_tensor(key), paddle.to_tensor(val))}
    cal.observe(caches)
    cal.observe({1: (paddle.to_tensor(key / 2), paddle.to_tensor(val / 2))})  # a later step: max kept
    fp8 = cal.scales(kv_cache_quant("float8_e4m3fn"))[1]
    np.testing.assert_allclose(fp8[0].numpy()[0], 9.0 / 448, rtol=1e-6)
    np.testing.assert_allclose(fp8[0].numpy()[1], np.abs(key[:, 1]).max() / 448, rtol=1e-6)
    np.testing.assert_allclose(fp8[1].numpy(), [np.abs(val[:, 0]).max() / 448, 1 / 448], rtol=1e-6)
    i8 = cal.scales(kv_cache_quant("int8"))[1]  # per channel [Hkv * D]
    want = np.abs(key).max(axis=(0, 2)).reshape(-1) / 127
    np.testing.assert_allclose(i8[0].numpy(), want, rtol=1e-6)
    assert i8[1].numpy().shape == (16,) and np.allclose(i8[1].numpy()[8:], 1 / 127)
    with pytest.raises(ValueError, match="dynamic"):
        cal.scales(kv_cache_quant("block_wise_fp8"))


@pytest.mark.parametrize("name", ["float8_e4m3fn", "int8"])
def test_calibrated_caches_write_with_fastdeploys_quant_multiplier(name):
    # FastDeploy's static write multiplies by cache_k_scale = T(max_bound / s), not by 1 / dequant:
    # the calibrated caches carry that multiplier, computed here in numpy (float64, one rounding)
    import paddle

    from fastdeploy_paddlefleet.kvcache.quant import kv_cache_quant
    from fastdeploy_paddlefleet.minifleet.config import load_raw_config
    from fastdeploy_paddlefleet.plan import plan_from_config
    from fastdeploy_paddlefleet.runner.batch import allocate_quantized_kv_caches
    from fastdeploy_paddlefleet.runner.kv_quant_compare import KVCalibration

    fmt = kv_cache_quant(name)
    layer = plan_from_config(load_raw_config("tiny")).layers[1]
    rng = np.random.default_rng(1)
    key = (rng.normal(size=(3, 2, 4, 16)) * 3.7).astype(np.float32)
    val = (rng.normal(size=(3, 2, 4, 8)) * 0.3).astype(np.float32)
    cal = KVCalibration([layer])
    cal.observe({1: (paddle.to_tensor(key), paddle.to_tensor(val))})
    (cache,) = allocate_quantized_kv_caches([layer], 3, 4, fmt, "float32", cal.scales(fmt))
    for x, dequant, mult in (
        (key, cache.key_scale, cache.key_quant_scale),
        (val, cache.value_scale, cache.value_quant_scale),
    ):
        amax = np.abs(x).max(axis=(0, 2))
        s = (amax.reshape(-1) if fmt.channel_wise else amax.max(axis=-1)).astype(np.float32)
        assert mult is not None
        np.testing.assert_array_equal(mult.numpy(), (fmt.max_bound / s.astype(np.float64)).astype(np.float32))
        np.testing.assert_array_equal(dequant.numpy(), s / np.float32(fmt.max_bound))


def test_headwise_kv_with_a_quantized_cache(capsys):
    code, rep = verify_json(
        capsys, "--preset", "tiny-headwise", "--headwise-kv", "--steps", "4", "--kv-cache-quant", "fp8"
    )
    assert code == 0 and rep["headwise_kv"] and rep["pages_released"] > 0
    assert rep["kv_cache_quant"]["nonfinite_positions"] == 0


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None,
    reason="triton backend needs triton and torch",
)
def test_triton_backend_figures_match_the_reference(capsys):
    # a fresh process: TRITON_INTERPRET must be set before triton is imported
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    args = ["verify", "--json", "--preset", "tiny", "--steps", "2", "--kv-cache-quant", "block_wise_fp8"]
    proc = subprocess.run(
        [sys.executable, "-m", "fastdeploy_paddlefleet.cli", *args, "--backend", "triton"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    tri = json.loads(proc.stdout)
    assert main([*args, "--backend", "reference"]) == 0
    ref = json.loads(capsys.readouterr().out)
    assert tri["backend"] == "triton" and tri["passed"]
    qt, qr = tri["kv_cache_quant"], ref["kv_cache_quant"]
    assert qt["positions"] == qr["positions"] and qt["top1_agreement"] == qr["top1_agreement"]
    assert abs(qt["max_abs_logit_error"] - qr["max_abs_logit_error"]) <= 1e-4
    assert abs(qt["mean_abs_logit_error"] - qr["mean_abs_logit_error"]) <= 1e-5
    for st, sr in zip(tri["per_step"], ref["per_step"], strict=True):
        assert abs(st["quant_max_abs_logit_error"] - sr["quant_max_abs_logit_error"]) <= 1e-4
