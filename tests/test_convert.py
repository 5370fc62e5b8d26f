"""``fdfleet convert dequantize`` (issue 33 item 4): gpt-oss MXFP4 and DeepSeek-V3 block FP8 -> bf16.

Every expected value here comes from a transcription of the formats written in this file from
their published descriptions (the E2M1 / E8M0 / E4M3FN bit fields, the nibble order and the scale
rules in ``docs/convert.md``), never from the converter's own tables; bfloat16 rounding is Python's
``round`` (ties to even) on the significand. ml_dtypes / torch, when installed, check the
transcription itself. The safetensors files the tests build and read back are written and parsed
here too (the format is 8 bytes of header length, the JSON header, the buffer).
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

np = pytest.importorskip("numpy")
pytest.importorskip("safetensors")

from fastdeploy_paddlefleet.cli import main  # noqa: E402
from fastdeploy_paddlefleet.convert import formats  # noqa: E402
from fastdeploy_paddlefleet.convert.dequantize import dequantize_checkpoint, plan_dequantize  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "data" / "configs"
BF16_MAX = (2 - 2**-7) * 2.0**127

# ---- the formats, transcribed -----------------------------------------------------------------


def ref_e2m1(code: int) -> float:
    """E2M1: bit 3 sign, bits 2-1 exponent (bias 1; 0 = subnormal), bit 0 mantissa."""
    sign = -1.0 if code & 0b1000 else 1.0
    e, m = (code >> 1) & 0b11, code & 1
    return sign * (m * 0.5 if e == 0 else (1 + m * 0.5) * 2.0 ** (e - 1))


def ref_e4m3fn(byte: int) -> float:
    """E4M3FN: bit 7 sign, bits 6-3 exponent (bias 7; 0 = subnormal), bits 2-0 mantissa; only
    S.1111.111 is NaN (no infinities)."""
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 0xF, byte & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    return sign * (m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def ref_bf16(x: float) -> float:
    """``x`` (a float32 value) rounded to bfloat16: 8 significant bits, ties to even; past the
    largest finite bfloat16 (by at least half an ulp) -> infinity."""
    if math.isnan(x) or math.isinf(x) or x == 0:
        return x
    m, e = math.frexp(x)  # x = m * 2**e, 0.5 <= |m| < 1
    e = max(e, -125)  # below the normal range the step stays 2**-133
    q = round(x / 2.0 ** (e - 8)) * 2.0 ** (e - 8)
    return math.copysign(math.inf, x) if abs(q) > BF16_MAX else q


def ref_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``[R, G, 16]`` bytes + ``[R, G]`` E8M0 -> float64 ``[R, G * 32]``: element ``2k`` of a block is
    the low nibble of byte ``k``, ``2k + 1`` the high one; times ``2**(scale - 127)``; 255 is NaN."""
    rows, groups, _ = blocks.shape
    out = np.empty((rows, groups * 32))
    for r in range(rows):
        for g in range(groups):
            s = int(scales[r, g])
            for k in range(16):
                byte = int(blocks[r, g, k])
                for j, code in enumerate((byte & 0xF, byte >> 4)):
                    v = math.nan if s == 255 else ref_e2m1(code) * 2.0 ** (s - 127)
                    out[r, g * 32 + 2 * k + j] = v
    return out


def ref_fp8(weight: np.ndarray, scale_inv: np.ndarray, bm: int, bn: int) -> np.ndarray:
    """``[M, N]`` E4M3FN bytes, scales per ``bm x bn`` block (edge blocks partial) -> float32 products."""
    m, n = weight.shape
    out = np.empty((m, n), dtype=np.float32)
    for i in range(m):
        for j in range(n):
            out[i, j] = np.float32(ref_e4m3fn(int(weight[i, j]))) * np.float32(scale_inv[i // bm, j // bn])
    return out


def bf16_values(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bits -> float32 values (a bfloat16 is the top half of a float32)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def same(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal values (signed zeros alike), NaN where NaN."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    nan = np.isnan(want)
    return bool((np.isnan(got) == nan).all() and (got[~nan] == want[~nan]).all())


# ---- the formats, checked ---------------------------------------------------------------------


def test_every_nibble_in_both_halves_of_a_byte():
    """All 256 bytes at scale 127 (2**0): low nibble first, the E2M1 table of the reference code."""
    blocks = np.arange(256, dtype=np.uint8).reshape(1, 16, 16)
    scales = np.full((1, 16), 127, dtype=np.uint8)
    got = formats.mxfp4_rows(blocks, scales)
    assert got.shape == (1, 512) and got.dtype == np.float32
    assert same(got, ref_mxfp4(blocks, scales))
    assert [ref_e2m1(c) for c in range(16)] == list(formats.E2M1_VALUES)  # the gpt-oss table
    assert got[0, 0] == 0.0 and got[0, 2 * 0x21] == 0.5 and got[0, 2 * 0x21 + 1] == 1.0  # byte 0x21


def test_random_blocks_and_extreme_exponents():
    """Random codes under every E8M0 corner: 0 (2**-127, bfloat16 subnormals), 1, 126, 127, 128,
    253, 254 (2**127: 2 and more overflow to inf) and 255 (NaN)."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(8, 3, 16), dtype=np.uint8)
    scales = np.array([0, 1, 126, 127, 128, 253, 254, 255] * 3, dtype=np.uint8).reshape(8, 3)
    got = formats.to_bf16_bits(formats.mxfp4_rows(blocks, scales))
    want = np.vectorize(ref_bf16)(ref_mxfp4(blocks, scales))
    assert same(bf16_values(got), want)
    assert np.isnan(bf16_values(got)[scales.repeat(32, axis=1) == 255]).all()
    assert np.isinf(bf16_values(got)).any()  # 254 with codes >= 2
    tiny = bf16_values(got)[scales.repeat(32, axis=1) == 0]
    assert np.abs(tiny[tiny != 0]).min() == 2.0**-128  # 0.5 * 2**-127 survives in bfloat16


def test_e4m3fn_every_byte():
    table = formats.e4m3fn_table()
    want = np.array([ref_e4m3fn(b) for b in range(256)])
    assert same(table, want)
    assert table[0x7E] == 448.0 and table[0xFE] == -448.0 and table[0x01] == 2.0**-9
    assert np.isnan(table[[0x7F, 0xFF]]).all() and np.isfinite(np.delete(table, [0x7F, 0xFF])).all()
    assert math.copysign(1, table[0x80]) == -1.0  # negative zero
    ml_dtypes = pytest.importorskip("ml_dtypes")  # the transcription against an implementation
    assert same(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64), want)


def test_fp8_blocks_with_partial_edges_and_specials():
    """300 x 260 in 128 x 128 blocks: a 3 x 3 grid whose last row and column of blocks are partial;
    the specials (NaN, -0, +-448, the smallest subnormal) under large and tiny scales."""
    rng = np.random.default_rng(1)
    weight = rng.integers(0, 256, size=(300, 260), dtype=np.uint8)
    weight[0, :6] = [0x7F, 0xFF, 0x80, 0x7E, 0xFE, 0x01]
    weight[299, 259] = 0x7E  # in the corner block (44 x 4 elements)
    scale = rng.uniform(1e-4, 1e-2, size=(3, 3)).astype(np.float32)
    # 448 * 7.59e35 is a finite float32 past bfloat16's largest value: infinity after rounding
    scale[2, 2], scale[0, 1] = np.float32(7.59e35), np.float32(1e-30)
    got = formats.fp8_block_rows(weight, scale, (128, 128))
    want32 = ref_fp8(weight, scale, 128, 128)
    assert same(got, want32)
    bits = formats.to_bf16_bits(got)
    assert same(bf16_values(bits), np.vectorize(ref_bf16)(want32.astype(np.float64)))
    assert np.isfinite(got[299, 259]) and np.isinf(bf16_values(bits)[299, 259])
    row = bf16_values(bits)[0, :6]
    assert np.isnan(row[:2]).all() and row[2] == 0 and math.copysign(1, row[2]) == -1


def test_bf16_rounding_ties_overflow_and_nan():
    one = 1.0
    ties = np.array(
        [one + 2**-8, one + 3 * 2**-8, one + 2**-8 + 2**-20, -(one + 2**-8), 2.0**-130 * 1.5, 3.4e38],
        dtype=np.float32,
    )
    got = bf16_values(formats.to_bf16_bits(ties))
    assert same(got, [ref_bf16(float(x)) for x in ties])
    assert got[0] == 1.0 and got[1] == 1 + 2**-6 and got[2] == 1 + 2**-7  # to even, to even, up
    special = np.array([np.inf, -np.inf, np.nan, -0.0], dtype=np.float32)
    out = bf16_values(formats.to_bf16_bits(special))
    assert out[0] == np.inf and out[1] == -np.inf and np.isnan(out[2]) and math.copysign(1, out[3]) == -1
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.random.default_rng(2).standard_normal(10_000).astype(np.float32) * 1e3
    assert (formats.to_bf16_bits(x) == x.astype(ml_dtypes.bfloat16).view(np.uint16)).all()


def test_format_inputs_are_checked():
    with pytest.raises(ValueError, match=r"blocks \[2, 16\] and scales \[3\]"):
        formats.mxfp4_rows(np.zeros((2, 16), np.uint8), np.zeros(3, np.uint8))
    with pytest.raises(TypeError, match="uint8"):
        formats.mxfp4_rows(np.zeros((2, 16), np.int8), np.zeros(2, np.uint8))
    with pytest.raises(ValueError, match=r"float32 scales \[2, 1\]"):
        formats.fp8_block_rows(np.zeros((129, 5), np.uint8), np.ones((1, 1), np.float32), (128, 128))


# ---- safetensors files, written and read here -------------------------------------------------


def write_st(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> None:
    """A safetensors file: ``name -> (dtype, shape, raw little-endian bytes)``."""
    header, blob = {"__metadata__": {"format": "pt"}}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [len(blob), len(blob) + len(raw)],
        }
        blob += raw
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + blob)


def read_st(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    base = 8 + n
    return {
        k: (v["dtype"], tuple(v["shape"]), data[base + v["data_offsets"][0] : base + v["data_offsets"][1]])
        for k, v in header.items()
    }


def bf16_raw(rng: np.random.Generator, shape: tuple[int, ...]) -> bytes:
    return formats_free_bf16(rng.standard_normal(shape).astype(np.float32)).tobytes()


def formats_free_bf16(x: np.ndarray) -> np.ndarray:
    """Truncated bfloat16 bits (inputs only: any bfloat16 will do)."""
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def write_index(src: Path, shards: dict[str, dict]) -> None:
    weight_map = {name: shard for shard, tensors in shards.items() for name in tensors}
    total = sum(len(t[2]) for tensors in shards.values() for t in tensors.values())
    (src / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )


def gpt_oss_checkpoint(src: Path) -> dict:
    """A tiny gpt-oss-20b-shaped MXFP4 checkpoint: 2 layers, 2 experts, hidden 64, intermediate 32,
    two shards (layer 1's scales in the shard of layer 0's), an index, a tokenizer, ``original/``."""
    rng = np.random.default_rng(3)
    src.mkdir()
    e, h, i = 2, 64, 32
    shards: dict[str, dict] = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for layer in range(2):
        shard = shards[f"model-0000{layer + 1}-of-00002.safetensors"]
        p = f"model.layers.{layer}.mlp.experts."
        for proj, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            blocks = rng.integers(0, 256, size=(e, rows, cols // 32, 16), dtype=np.uint8)
            scales = rng.integers(118, 131, size=(e, rows, cols // 32), dtype=np.uint8)
            scales[0, 0, 0], scales[-1, -1, -1] = 0, 254
            shard[p + proj + "_blocks"] = ("U8", blocks.shape, blocks.tobytes())
            (shards["model-00001-of-00002.safetensors"] if layer == 1 else shard)[p + proj + "_scales"] = (
                "U8",
                scales.shape,
                scales.tobytes(),
            )
            shard[p + proj + "_bias"] = ("BF16", (e, rows), bf16_raw(rng, (e, rows)))
        shard[f"model.layers.{layer}.self_attn.q_proj.weight"] = ("BF16", (h, h), bf16_raw(rng, (h, h)))
        shard[f"model.layers.{layer}.self_attn.sinks"] = ("BF16", (4,), bf16_raw(rng, (4,)))
        shard[f"model.layers.{layer}.mlp.router.weight"] = ("BF16", (e, h), bf16_raw(rng, (e, h)))
    shards["model-00002-of-00002.safetensors"]["model.embed_tokens.weight"] = (
        "BF16",
        (10, h),
        bf16_raw(rng, (10, h)),
    )
    for name, tensors in shards.items():
        write_st(src / name, tensors)
    write_index(src, shards)
    # the published config.json; that mirror's quant_method reads gptq, openai/gpt-oss-20b's mxfp4
    config = json.loads((CONFIGS / "gpt-oss-20b.json").read_text())
    config["quantization_config"]["quant_method"] = "mxfp4"
    (src / "config.json").write_text(json.dumps(config, indent=2))
    (src / "tokenizer.json").write_text('{"version": "1.0"}')
    (src / "generation_config.json").write_text('{"eos_token_id": 1}')
    (src / "original").mkdir()
    (src / "original" / "model.safetensors").write_bytes(b"not copied")
    return {"shards": shards, "config": config}


def deepseek_checkpoint(src: Path) -> dict:
    """A tiny DeepSeek-V3-shaped block-FP8 checkpoint: 2 shards with weights of whole and partial
    128 x 128 blocks (one weight's scale_inv in the other shard), bf16 norms, an fp32 bias."""
    rng = np.random.default_rng(4)
    src.mkdir()
    shards: dict[str, dict] = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    a, b = shards.values()
    weights = {
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": (a, a, (200, 130)),
        "model.layers.0.mlp.experts.0.down_proj.weight": (a, b, (128, 256)),  # scale in the other shard
        "model.layers.1.mlp.gate_proj.weight": (b, b, (300, 70)),
    }
    for name, (w_shard, s_shard, (m, n)) in weights.items():
        w = rng.integers(0, 256, size=(m, n), dtype=np.uint8)
        w[0, :4] = [0x7F, 0x80, 0x7E, 0x01]
        s = rng.uniform(1e-4, 1e-2, size=(-(-m // 128), -(-n // 128))).astype("<f4")
        w_shard[name] = ("F8_E4M3", (m, n), w.tobytes())
        s_shard[name + "_scale_inv"] = ("F32", s.shape, s.tobytes())
    a["model.layers.0.input_layernorm.weight"] = ("BF16", (64,), bf16_raw(rng, (64,)))
    b["model.layers.1.mlp.gate.e_score_correction_bias"] = (
        "F32",
        (8,),
        rng.standard_normal(8).astype("<f4").tobytes(),
    )
    b["lm_head.weight"] = ("BF16", (10, 64), bf16_raw(rng, (10, 64)))
    for name, tensors in shards.items():
        write_st(src / name, tensors)
    write_index(src, shards)
    config = json.loads((CONFIGS / "deepseek-v3.json").read_text())  # the published config.json
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    (src / "config.json").write_text(json.dumps(config, indent=2))
    (src / "tokenizer_config.json").write_text("{}")
    return {"shards": shards, "config": config, "weights": weights}


def all_tensors(shards: dict[str, dict]) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    return {k: v for tensors in shards.values() for k, v in tensors.items()}


def plan_warnings(path: Path, capsys) -> list[str]:
    assert main(["plan", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["warnings"]


def convert_json(src: Path, dst: Path, capsys) -> dict:
    """``fdfleet convert dequantize SRC DST --json``'s report, after ``fdfleet plan SRC`` warned
    that serving refuses SRC, naming the converter."""
    assert any("fdfleet convert dequantize" in w for w in plan_warnings(src, capsys))
    assert main(["convert", "dequantize", str(src), str(dst), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# ---- end to end -------------------------------------------------------------------------------


def test_gpt_oss_mxfp4_end_to_end(tmp_path, capsys):
    src, dst = tmp_path / "gpt-oss", tmp_path / "gpt-oss-bf16"
    made = gpt_oss_checkpoint(src)
    report = convert_json(src, dst, capsys)
    assert report["converted"] == {"mxfp4": 4} and report["dropped"] == 4 and report["copied"] == 11
    assert report["quant_method"] == "mxfp4" and report["dtype"] == "bf16"
    assert report["skipped"] == ["original"] and report["files"] == [
        "generation_config.json",
        "tokenizer.json",
    ]
    assert report["bytes_in"] == sum((src / s).stat().st_size for s in made["shards"])
    assert report["bytes_out"] == sum((dst / s).stat().st_size for s in made["shards"])

    source = all_tensors(made["shards"])
    out = {}
    for shard in made["shards"]:
        for name, value in read_st(dst / shard).items():
            out[name] = value
            if name in source:  # copied: same shard as before, byte for byte
                assert value == source[name] and name in made["shards"][shard]
    assert not [n for n in out if n.endswith(("_blocks", "_scales"))]
    nonfinite = 0
    for layer in range(2):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            _, bshape, braw = source[name + "_blocks"]
            _, sshape, sraw = source[name + "_scales"]
            blocks = np.frombuffer(braw, np.uint8).reshape(bshape)
            scales = np.frombuffer(sraw, np.uint8).reshape(sshape)
            dtype, shape, raw = out[name]
            e, rows, groups, _ = bshape
            assert dtype == "BF16" and shape == (e, groups * 32, rows)  # [E, in, out]: transformers' layout
            got = bf16_values(np.frombuffer(raw, "<u2").reshape(shape))
            for ex in range(e):
                want = np.vectorize(ref_bf16)(ref_mxfp4(blocks[ex], scales[ex]))  # [R, G * 32]
                assert same(got[ex], want.T), (name, ex)
                nonfinite += int((~np.isfinite(want)).sum())
    assert report["nonfinite"] == nonfinite > 0  # scale 254 under codes of magnitude >= 2: inf
    assert set(out) == {n for n in source if not n.endswith(("_blocks", "_scales"))} | {
        f"model.layers.{layer}.mlp.experts.{proj}"
        for layer in range(2)
        for proj in ("gate_up_proj", "down_proj")
    }
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {name: shard for shard in made["shards"] for name in read_st(dst / shard)}
    assert index["metadata"]["total_size"] == sum(len(v[2]) for v in out.values())
    config = json.loads((dst / "config.json").read_text())
    assert config == {k: v for k, v in made["config"].items() if k != "quantization_config"}
    assert (dst / "tokenizer.json").read_text() == '{"version": "1.0"}' and not (dst / "original").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt-oss", "gpt-oss-bf16"]  # no temporary left
    assert not [w for w in plan_warnings(dst, capsys) if "quantiz" in w]
    torch = pytest.importorskip("torch")  # another reader of the output: safetensors' own
    from safetensors.torch import load_file

    loaded = load_file(str(dst / "model-00001-of-00002.safetensors"))
    gate_up = loaded["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.dtype == torch.bfloat16 and tuple(gate_up.shape) == (2, 64, 64)
    assert same(
        gate_up.float().numpy(),
        bf16_values(np.frombuffer(out["model.layers.0.mlp.experts.gate_up_proj"][2], "<u2")).reshape(
            2, 64, 64
        ),
    )


def test_deepseek_fp8_end_to_end(tmp_path, capsys):
    src, dst = tmp_path / "dsv3", tmp_path / "dsv3-bf16"
    made = deepseek_checkpoint(src)
    report = convert_json(src, dst, capsys)
    assert report["converted"] == {"fp8": 3} and report["dropped"] == 3 and report["copied"] == 3
    source = all_tensors(made["shards"])
    out = {}
    for shard in made["shards"]:
        out.update(read_st(dst / shard))
    assert set(out) == {n for n in source if not n.endswith("_scale_inv")}
    nonfinite = 0
    for name, (w_shard, _, (m, n)) in made["weights"].items():
        assert name in read_st(dst / next(s for s, t in made["shards"].items() if t is w_shard))
        weight = np.frombuffer(source[name][2], np.uint8).reshape(m, n)
        scale = np.frombuffer(source[name + "_scale_inv"][2], "<f4").reshape(source[name + "_scale_inv"][1])
        dtype, shape, raw = out[name]
        assert dtype == "BF16" and shape == (m, n)
        want = np.vectorize(ref_bf16)(ref_fp8(weight, scale, 128, 128).astype(np.float64))
        assert same(bf16_values(np.frombuffer(raw, "<u2").reshape(m, n)), want), name
        nonfinite += int((~np.isfinite(want)).sum())
    assert report["nonfinite"] == nonfinite > 0  # the NaN bytes stay NaN
    for name in ("model.layers.0.input_layernorm.weight", "model.layers.1.mlp.gate.e_score_correction_bias"):
        assert out[name] == source[name]
    config = json.loads((dst / "config.json").read_text())
    assert config == {k: v for k, v in made["config"].items() if k != "quantization_config"}
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert not [n for n in index["weight_map"] if n.endswith("_scale_inv")]
    assert not [w for w in plan_warnings(dst, capsys) if "quantiz" in w]


def test_fp32_output_and_python_dash_m(tmp_path):
    src = tmp_path / "dsv3"
    made = deepseek_checkpoint(src)
    dst = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastdeploy_paddlefleet.convert",
            "dequantize",
            str(src),
            str(dst),
            "--dtype",
            "fp32",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"wrote {dst}: 3 fp8 tensor(s) dequantized to fp32")
    name = "model.layers.1.mlp.gate_proj.weight"
    weight = np.frombuffer(all_tensors(made["shards"])[name][2], np.uint8).reshape(300, 70)
    scale = np.frombuffer(all_tensors(made["shards"])[name + "_scale_inv"][2], "<f4").reshape(3, 1)
    dtype, shape, raw = read_st(dst / "model-00002-of-00002.safetensors")[name]
    assert dtype == "F32" and same(np.frombuffer(raw, "<f4").reshape(shape), ref_fp8(weight, scale, 128, 128))


def test_a_single_file_checkpoint_gets_no_index(tmp_path):
    src = tmp_path / "one"
    src.mkdir()
    blocks = np.arange(2 * 3 * 2 * 16, dtype=np.uint8).reshape(2, 3, 2, 16)
    scales = np.full((2, 3, 2), 127, np.uint8)
    write_st(
        src / "model.safetensors",
        {
            "m.experts.down_proj_blocks": ("U8", blocks.shape, blocks.tobytes()),
            "m.experts.down_proj_scales": ("U8", scales.shape, scales.tobytes()),
        },
    )
    (src / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "mxfp4"}, "x": 1}))
    report = dequantize_checkpoint(src, tmp_path / "dst")
    assert (
        report.shards == ["model.safetensors"]
        and not (tmp_path / "dst" / "model.safetensors.index.json").exists()
    )
    assert json.loads((tmp_path / "dst" / "config.json").read_text()) == {"x": 1}
    dtype, shape, raw = read_st(tmp_path / "dst" / "model.safetensors")["m.experts.down_proj"]
    assert shape == (2, 64, 3)
    assert same(bf16_values(np.frombuffer(raw, "<u2").reshape(shape))[1], ref_mxfp4(blocks[1], scales[1]).T)


# ---- refusals and failures --------------------------------------------------------------------


def fp8_src(tmp_path: Path) -> Path:
    src = tmp_path / "dsv3"
    deepseek_checkpoint(src)
    return src


def test_unknown_quant_method_exits_2_naming_it(tmp_path, capsys):
    src = fp8_src(tmp_path)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (src / "config.json").write_text(json.dumps(config))
    assert main(["convert", "dequantize", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "quant_method 'awq' is not a format the converter knows" in err and "'mxfp4', 'fp8'" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda c: c.pop("quantization_config"), "no quantization_config: nothing to dequantize"),
        (lambda c: c["quantization_config"].update(weight_block_size=None), "weight_block_size None"),
        (lambda c: c["quantization_config"].update(fmt="e5m2"), "fmt 'e5m2'"),
        (lambda c: c["quantization_config"].update(activation_scheme="static"), "activation_scheme 'static'"),
        (lambda c: c["quantization_config"].update(weight_block_size=[128, 64]), "needs F32 \\[2, 3\\]"),
    ],
)
def test_bad_configs_are_named(tmp_path, edit, match):
    src = fp8_src(tmp_path)
    config = json.loads((src / "config.json").read_text())
    edit(config)
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        plan_dequantize(src)


def test_a_missing_scale_a_stale_index_and_a_damaged_shard_are_named(tmp_path):
    src = fp8_src(tmp_path)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "model-00001-of-00002.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        ValueError, match="weight_map does not say where the tensors are, e.g. \\['lm_head.weight'\\]"
    ):
        plan_dequantize(src)
    index["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    shard = src / "model-00002-of-00002.safetensors"
    tensors = read_st(shard)
    tensors.pop("model.layers.1.mlp.gate_proj.weight_scale_inv")
    write_st(shard, tensors)
    index["weight_map"].pop("model.layers.1.mlp.gate_proj.weight_scale_inv")
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="'model.layers.1.mlp.gate_proj.weight' is F8_E4M3 with no scale"):
        plan_dequantize(src)
    data = shard.read_bytes()
    shard.write_bytes(data[:-5])
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors.*truncated or damaged"):
        plan_dequantize(src)


def test_mxfp4_blocks_without_scales_are_named(tmp_path):
    src = tmp_path / "g"
    made = gpt_oss_checkpoint(src)
    shard = src / "model-00001-of-00002.safetensors"
    tensors = read_st(shard)
    tensors.pop("model.layers.1.mlp.experts.down_proj_scales")
    write_st(shard, tensors)
    made["shards"]["model-00001-of-00002.safetensors"].pop("model.layers.1.mlp.experts.down_proj_scales")
    write_index(src, made["shards"])
    with pytest.raises(ValueError, match="'model.layers.1.mlp.experts.down_proj_blocks' has no .*_scales"):
        plan_dequantize(src)


def test_a_fifo_in_the_source_is_refused_without_blocking(tmp_path, capsys):
    src = fp8_src(tmp_path)
    os.mkfifo(src / "vocab.txt")
    assert main(["convert", "dequantize", str(src), str(tmp_path / "out")]) == 2
    assert "vocab.txt' is a FIFO (named pipe)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_non_empty_target_needs_force_which_keeps_other_files(tmp_path, capsys):
    src = fp8_src(tmp_path)
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    (dst / "config.json").write_text("old")
    assert main(["convert", "dequantize", str(src), str(dst)]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert (dst / "config.json").read_text() == "old"
    assert main(["convert", "dequantize", str(src), str(dst), "--force", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kept"] == ["notes.txt"]
    assert (dst / "notes.txt").read_text() == "mine" and "quant" not in (dst / "config.json").read_text()


def test_force_refuses_the_working_directory_and_the_source(tmp_path, monkeypatch, capsys):
    src = fp8_src(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep").write_text("x")
    monkeypatch.chdir(work)
    assert main(["convert", "dequantize", str(src), ".", "--force"]) == 2
    assert "is the current directory" in capsys.readouterr().err
    assert main(["convert", "dequantize", str(src), str(src), "--force"]) == 2
    assert "is the source checkpoint" in capsys.readouterr().err
    assert sorted(p.name for p in work.iterdir()) == ["keep"]


def test_a_symlinked_target_is_written_through(tmp_path):
    src = fp8_src(tmp_path)
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    dequantize_checkpoint(src, tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and (real / "config.json").exists()


def test_a_full_disk_exits_74_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    import errno

    from fastdeploy_paddlefleet.convert import safetensors_io

    src = fp8_src(tmp_path)
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "config.json").write_text("old")
    calls = []

    def full(self, name, data):
        calls.append(name)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors_io.Writer, "write", full)
    assert main(["convert", "dequantize", str(src), str(dst), "--force"]) == 74
    err = capsys.readouterr().err
    assert "No space left on device" in err and "left as it was" in err and str(dst) in err
    assert (
        sorted(p.name for p in dst.iterdir()) == ["config.json"]
        and (dst / "config.json").read_text() == "old"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dsv3", "out"]


def test_too_little_free_space_is_refused_before_writing(tmp_path, monkeypatch, capsys):
    import shutil

    src = fp8_src(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 10))
    assert main(["convert", "dequantize", str(src), str(tmp_path / "out")]) == 74
    assert "needs" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_ctrl_c_exits_130_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    from fastdeploy_paddlefleet.convert import dequantize

    src = fp8_src(tmp_path)

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(dequantize, "_copy_file", interrupted)
    assert main(["convert", "dequantize", str(src), str(tmp_path / "out")]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dsv3"]


def test_a_source_that_shrinks_mid_read_is_a_read_error(tmp_path, monkeypatch, capsys):
    from fastdeploy_paddlefleet.convert import dequantize

    src = fp8_src(tmp_path)
    real = dequantize._fp8_pieces

    def shrink(job, *a):
        (src / "model-00002-of-00002.safetensors").write_bytes(b"")  # truncated under us
        yield from real(job, *a)

    monkeypatch.setattr(dequantize, "_fp8_pieces", shrink)
    assert main(["convert", "dequantize", str(src), str(tmp_path / "out")]) == 74
    assert "shrank" in capsys.readouterr().err and not (tmp_path / "out").exists()


# ---- where the user meets it ------------------------------------------------------------------


def test_the_load_time_refusal_names_the_converter():
    from fastdeploy_paddlefleet.serving.checks import check_quantization

    for method, hint in (("mxfp4", "fdfleet convert dequantize SRC DST"), ("fp8", "docs/convert.md")):
        cfg = {"model_config": {"quantization_config": {"quant_method": method}}}
        with pytest.raises(ValueError, match=hint):
            check_quantization(cfg, "GptOssForCausalLM")
    with pytest.raises(ValueError, match="reads mxfp4 and fp8 checkpoints only"):
        check_quantization({"model_config": {"quantization_config": {"quant_method": "awq"}}}, "X")


def test_the_convert_modules_import_nothing_heavy():
    code = (
        "import sys, json\n"
        "import fastdeploy_paddlefleet.convert, fastdeploy_paddlefleet.cli.convert\n"
        "from fastdeploy_paddlefleet.cli import build_parser\n"
        "build_parser()\n"
        "heavy = ('numpy', 'safetensors', 'torch', 'paddle')\n"
        "print(json.dumps(sorted(m for m in heavy if m in sys.modules)))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == []


def test_missing_action_is_named(capsys):
    assert main(["convert"]) == 2
    assert "name an action: dequantize" in capsys.readouterr().err
