"""PaddleFleet's REAL core attention in a tiny model, for the conformance tests (tests/hosts).

Where the host comes from (:func:`locate_host`):

1. ``$FDFLEET_HOST_PADDLEFLEET``: a folder holding the ``paddlefleet`` package
   sources (four unmodified PaddleFleet files);
2. when the variable is unset or empty, :data:`HOST_DEFAULT`
   (``~/.cache/fdfleet-hosts/paddlefleet/src``, where README's instructions put them) if it holds them;
3. otherwise an installed ``paddlefleet`` (its package folder is used the same way);
4. otherwise :func:`host_or_skip` skips the test with a reason.

The real files, imported and run unmodified (:func:`load_host`):
``transformer/dot_product_attention.py`` (``DotProductAttention``,
``build_softmax_offset``), ``transformer/utils.py`` (``is_layer_window_attention``,
``startend_row_indices_add_sliding_window``, ``attention_mask_func``),
``transformer/enums.py`` (``AttnMaskType``), ``fusions/fused_softmax.py``
(``FusedScaleMaskSoftmax``, ``SoftmaxOne``).

Stand-ins, each inserted into ``sys.modules`` only while the real files are
imported (then the previous entries are put back), and why (:data:`STAND_INS`):

* ``paddlefleet``, ``paddlefleet.transformer``, ``paddlefleet.fusions``
  (``paddlefleet.transformer.attention`` for the newest layout): bare packages
  whose ``__path__`` is the host folder, so the real files load from it; the
  real ``__init__`` s import the whole framework (and are not in the host copy);
* ``paddlefleet_ops.flash_mask_facade``: the compiled FlashMask kernels (GPU,
  half precision). ``flashmask_attention`` is a dense numpy equivalent written
  from Paddle's documented start/end-row rules (``paddle.nn.functional.flashmask_attention``:
  column ``j``'s rows at or below ``LTS[j]`` masked, causal adds ``j > i``), a
  learnable sink joining the denominator unscaled; ``get_fa_version`` says 2
  and ``needs_value_padding`` pads V when ``qk != v`` (FlashAttention-2's rule,
  so the real value-padding code runs); ``flash_attention`` is only on the
  EC-alignment path, never taken here, and raises;
* ``paddlefleet.context_parallel_utils``, ``paddlefleet.refined_recompute``:
  context-parallel and refined-recompute kernels; not on these paths (cp = 1,
  no recompute), so they raise if called;
* ``paddlefleet.parallel_state`` (context-parallel world size 1),
  ``paddlefleet.process_groups_config`` (no TP group: world size 1),
  ``paddlefleet.utils.divide`` (exact division), ``paddlefleet.transformer.layer.FleetLayer``
  (a ``paddle.nn.Layer`` taking ``config``), ``paddlefleet.training.global_vars``
  (no profile timers): framework plumbing with no effect on the math.

The rest of the model is ours (:class:`TinyFleetGPT`), shaped like PaddleFleet's:
``FleetConfig`` stands in for ``TransformerConfig`` (its defaults: ``v_head_dim``
-> ``head_dim``, ``swa_*`` -> the full-attention values, ``swa_v_head_dim`` ->
``v_head_dim``); ``SelfAttention`` / ``MLASelfAttention`` build the real
``DotProductAttention`` with the arguments PaddleFleet's ``Attention`` /
``MultiLatentAttention`` pass (``is_swa`` from the real ``is_layer_window_attention``
with PaddleFleet's layer numbering; MLA without ``is_swa`` / ``num_key_value_heads``,
its own yarn scale); embeddings, RMSNorm, rotate-half RoPE, SwiGLU MLP and the LM
head are plain stand-ins (the attention is what is under test). An MTP layer's
output is added to the hidden state the LM head reads (unlike PaddleFleet, where it
feeds separate MTP logits) so that its attention shows in the compared logits.

The real FlashMask branch runs only for half-precision queries (the kernels are
bf16/fp16 only). To run it in fp32, the model hands the real class a query
wrapped in :class:`Bf16Label`, whose ``dtype`` reads ``bfloat16`` while its
values stay fp32: past the dtype gate the branch casts it with
``query.astype(value.dtype)`` and everything runs on fp32 tensors.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F

HOST_VAR = "FDFLEET_HOST_PADDLEFLEET"
#: where README ("Conformance tests against the hosts' real code") puts PaddleFleet's files
HOST_DEFAULT = "~/.cache/fdfleet-hosts/paddlefleet/src"

#: the stand-in modules and why each is stood in (see the module doc)
STAND_INS: dict[str, str] = {
    "paddlefleet": "bare package over the host folder (the real __init__ imports the whole framework)",
    "paddlefleet.transformer": "bare package over the host folder",
    "paddlefleet.fusions": "bare package over the host folder",
    "paddlefleet_ops.flash_mask_facade": "compiled GPU FlashMask kernels -> dense numpy equivalent",
    "paddlefleet.context_parallel_utils": "context-parallel kernels (cp = 1 here): raise if called",
    "paddlefleet.refined_recompute": "refined-recompute kernels (not used): raise if called",
    "paddlefleet.parallel_state": "context-parallel world size 1",
    "paddlefleet.process_groups_config": "no tensor-parallel group (world size 1)",
    "paddlefleet.utils": "divide(): exact integer division",
    "paddlefleet.transformer.layer": "FleetLayer: a paddle.nn.Layer taking config",
    "paddlefleet.training.global_vars": "no profile timers",
}


@dataclass(frozen=True)
class Host:
    """Where PaddleFleet's sources are: ``root/paddlefleet/transformer/...``."""

    root: Path
    origin: str  # "env", "default" (HOST_DEFAULT) or "installed"

    def attention_file(self) -> Path:
        for rel in ("transformer/dot_product_attention.py", "transformer/attention/dot_product_attention.py"):
            path = self.root / "paddlefleet" / rel
            if path.is_file():
                return path
        raise FileNotFoundError(f"no dot_product_attention.py under {self.root / 'paddlefleet'}")


def locate_host() -> tuple[Host | None, str]:
    """``(host, reason)``; ``host`` is None when there is none (``reason`` says why)."""
    env = os.environ.get(HOST_VAR)
    if env:
        root = Path(env)
        if (root / "paddlefleet" / "transformer" / "utils.py").is_file():
            return Host(root, "env"), ""
        return None, f"{HOST_VAR}={env!r} holds no paddlefleet/transformer/utils.py"
    default = Path(HOST_DEFAULT).expanduser()
    if (default / "paddlefleet" / "transformer" / "utils.py").is_file():
        return Host(default, "default"), ""
    loaded = sys.modules.get("paddlefleet")
    try:
        spec = loaded.__spec__ if loaded is not None else importlib.util.find_spec("paddlefleet")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Host(Path(next(iter(spec.submodule_search_locations))).parent, "installed"), ""
    return None, (
        f"PaddleFleet's code not found: {HOST_VAR} is not set, {HOST_DEFAULT} holds no "
        "paddlefleet/transformer/utils.py and no paddlefleet is installed"
    )


def host_or_skip() -> Host:
    import pytest

    host, reason = locate_host()
    if host is None:
        pytest.skip(reason)
    return host


# ----------------------------------------------------------------------------- FlashMask stand-in


def dense_flashmask_mask(rows: np.ndarray, q_len: int, causal: bool) -> np.ndarray:
    """``rows [b, h, s, cols]`` start/end rows -> ``[b, h, q_len, s]`` bool, True = masked.

    Paddle's documented rules (``paddle.nn.functional.flashmask_attention``), for
    key column ``j`` and query row ``i``: causal, 1 column ``LTS``: masked iff
    ``i >= LTS[j]``; causal, 2 columns: ``LTS[j] <= i < LTE[j]``; non-causal, 2
    columns: ``i >= LTS[j]`` or ``i < UTE[j]``; non-causal, 4 columns:
    ``LTS <= i < LTE`` or ``UTS <= i < UTE``. Causal also masks ``j > i``.
    """
    b, h, s, cols = rows.shape
    i = np.arange(q_len).reshape(1, 1, q_len, 1)
    col = [rows[..., c].reshape(b, h, 1, s) for c in range(cols)]
    if causal:
        if cols == 1:
            masked = i >= col[0]
        elif cols == 2:
            masked = (i >= col[0]) & (i < col[1])
        else:
            raise ValueError(f"causal FlashMask rows have 1 or 2 columns, got {cols}")
        return masked | (np.arange(s).reshape(1, 1, 1, s) > i)
    if cols == 2:
        return (i >= col[0]) | (i < col[1])
    if cols == 4:
        return ((i >= col[0]) & (i < col[1])) | ((i >= col[2]) & (i < col[3]))
    raise ValueError(f"non-causal FlashMask rows have 2 or 4 columns, got {cols}")


def flashmask_attention(
    query: paddle.Tensor,
    key: paddle.Tensor,
    value: paddle.Tensor,
    startend_row_indices: paddle.Tensor | None = None,
    *,
    dropout: float = 0.0,
    causal: bool = False,
    softmax_scale: float | None = None,
    learnable_sink: paddle.Tensor | None = None,
    **kwargs: Any,
) -> paddle.Tensor:
    """Dense CPU FlashMask: ``q [b, s, Hq, D]``, ``k [b, s, Hk, D]``, ``v [b, s, Hk, Dv]``.

    Returns ``[b, s, Hq, Dv]`` in ``value``'s dtype.

    Scores ``scale * <q, k>`` (``scale`` default ``D ** -0.5``); GQA query head
    ``h`` reads kv head ``h // (Hq / Hk)`` and mask head ``h // (Hq / Hm)``
    (``Hm`` = 1 or ``Hk``); a learnable sink ``[Hq]`` adds ``exp(sink)`` to the
    denominator; a row with nothing visible gives zeros. Computed in float64.
    """
    if dropout:
        raise ValueError(f"the FlashMask stand-in has no dropout, got {dropout}")
    unknown = {k: v for k, v in kwargs.items() if v not in (None, False, 0, 0.0, "")}
    if unknown:
        raise ValueError(f"the FlashMask stand-in does not implement {sorted(unknown)}")
    q = query.astype("float64").numpy()
    k = key.astype("float64").numpy()
    v = value.astype("float64").numpy()
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if sq != sk:
        raise ValueError(f"the FlashMask stand-in needs q_len == k_len, got {sq}, {sk}")
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
    kv_of = np.arange(hq) // (hq // hk)
    scores = np.einsum("bihd,bjhd->bhij", q, k[:, :, kv_of]) * scale  # [b, Hq, i, j]
    if startend_row_indices is not None:
        rows = startend_row_indices.numpy().astype(np.int64)
        hm = rows.shape[1]
        if hm not in (1, hk):
            raise ValueError(f"startend_row_indices has {hm} heads, expected 1 or {hk}")
        masked = dense_flashmask_mask(rows, sq, causal)[
            :, (np.arange(hq) // (hq // hm)) if hm > 1 else [0] * hq
        ]
    else:
        masked = (
            np.broadcast_to(np.triu(np.ones((sq, sk), dtype=bool), 1), (b, hq, sq, sk)) if causal else None
        )
    if masked is not None:
        scores = np.where(masked, -np.inf, scores)
    m = scores.max(axis=-1, keepdims=True)
    sink = None
    if learnable_sink is not None:
        sink = learnable_sink.astype("float64").numpy().reshape(1, hq, 1, 1)
        m = np.maximum(m, sink)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(scores - m)
    denom = e.sum(axis=-1, keepdims=True) + (0.0 if sink is None else np.exp(sink - m))
    p = np.divide(e, denom, out=np.zeros_like(e), where=denom > 0)
    out = np.einsum("bhij,bjhd->bihd", p, v[:, :, kv_of])
    return paddle.to_tensor(out.astype(np.float32)).astype(value.dtype)


def _unused(what: str):
    def call(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{what} is stood in and not on the tested paths")

    return call


# ----------------------------------------------------------------------------- loading the real files


@dataclass
class HostModules:
    """The real classes and functions, loaded from the host's files."""

    host: Host
    DotProductAttention: type
    AttnMaskType: Any
    utils: types.ModuleType
    fused_softmax: types.ModuleType
    files: list[str]


def _package(name: str, path: Path) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = [str(path)]
    module.__package__ = name
    return module


def _stand_in_modules(host: Host) -> dict[str, types.ModuleType]:
    pkg = host.root / "paddlefleet"
    mods = {
        "paddlefleet": _package("paddlefleet", pkg),
        "paddlefleet.transformer": _package("paddlefleet.transformer", pkg / "transformer"),
        "paddlefleet.transformer.attention": _package(
            "paddlefleet.transformer.attention", pkg / "transformer" / "attention"
        ),
        "paddlefleet.fusions": _package("paddlefleet.fusions", pkg / "fusions"),
        "paddlefleet.training": _package("paddlefleet.training", pkg / "training"),
        "paddlefleet_ops": _package("paddlefleet_ops", pkg / "_none_"),
    }

    def module(name: str, **attrs: Any) -> None:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        mods[name] = m

    module(
        "paddlefleet_ops.flash_mask_facade",
        flash_attention=_unused("flash_attention (EC-alignment path)"),
        flashmask_attention=flashmask_attention,
        get_fa_version=lambda q_head_dim, v_head_dim, startend_row_indices=None: 2,
        needs_value_padding=lambda fa_version, q_head_dim, v_head_dim: q_head_dim != v_head_dim,
    )
    module("paddlefleet.context_parallel_utils", flashmask_attention_cp=_unused("flashmask_attention_cp"))

    class _RefinedRecompute:
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError("refined recompute is stood in and not on the tested paths")

    module(
        "paddlefleet.refined_recompute",
        RefinedRcomputeFlashMaskAttention=_RefinedRecompute,
        RefinedRcomputeFlashMaskCpAttention=_RefinedRecompute,
    )
    module("paddlefleet.parallel_state", get_context_parallel_world_size=lambda: 1)

    class ProcessGroupCollection:
        tp = None

        @classmethod
        def use_mpu_process_groups(cls, required_pgs: Any = None) -> ProcessGroupCollection:
            return cls()

    module("paddlefleet.process_groups_config", ProcessGroupCollection=ProcessGroupCollection)

    def divide(numerator: int, denominator: int) -> int:
        if numerator % denominator:
            raise ValueError(f"{numerator} is not divisible by {denominator}")
        return numerator // denominator

    module("paddlefleet.utils", divide=divide)

    class FleetLayer(paddle.nn.Layer):
        def __init__(self, config: Any = None, **kwargs: Any) -> None:
            super().__init__()

    module("paddlefleet.transformer.layer", FleetLayer=FleetLayer)
    module("paddlefleet.training.global_vars", get_profile_timers=lambda: None)
    return mods


@contextmanager
def _modules_inserted(mods: dict[str, types.ModuleType]) -> Iterator[None]:
    """Insert ``mods`` into ``sys.modules``; afterwards remove every ``paddlefleet*`` module the
    block added and put back what was there before."""
    prefixes = ("paddlefleet", "paddlefleet_ops")
    before = {n: m for n, m in sys.modules.items() if n.split(".")[0] in prefixes}
    sys.modules.update(mods)
    try:
        yield
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] in prefixes]:
            del sys.modules[name]
        sys.modules.update(before)


_LOADED: dict[Path, HostModules] = {}


def load_host(host: Host) -> HostModules:
    """Import the real files of ``host`` (once per process) with the stand-ins around them."""
    if host.root in _LOADED:
        return _LOADED[host.root]
    attention_file = host.attention_file()
    attention_name = "paddlefleet." + ".".join(
        attention_file.relative_to(host.root / "paddlefleet").with_suffix("").parts
    )
    with _modules_inserted(_stand_in_modules(host)):
        dpa = importlib.import_module(attention_name)
        utils = importlib.import_module("paddlefleet.transformer.utils")
        enums = importlib.import_module("paddlefleet.transformer.enums")
        fused = importlib.import_module("paddlefleet.fusions.fused_softmax")
    files = [m.__file__ for m in (dpa, utils, enums, fused)]
    loaded = HostModules(host, dpa.DotProductAttention, enums.AttnMaskType, utils, fused, files)
    _LOADED[host.root] = loaded
    return loaded


# ----------------------------------------------------------------------------- the tiny model


class Bf16Label:
    """An fp32 tensor whose ``dtype`` reads ``bfloat16`` (see the module doc); everything else,
    ``astype`` included, is the wrapped tensor's."""

    def __init__(self, tensor: paddle.Tensor) -> None:
        self._tensor = tensor

    @property
    def dtype(self) -> Any:
        return paddle.bfloat16

    @property
    def shape(self) -> list[int]:
        return self._tensor.shape

    def astype(self, dtype: Any) -> paddle.Tensor:
        return self._tensor.astype(dtype)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tensor, name)


def _init_normal(param: paddle.Tensor) -> None:
    param.set_value(paddle.normal(shape=param.shape).astype(param.dtype))


class FleetConfig(types.SimpleNamespace):
    """Stand-in for PaddleFleet's ``TransformerConfig``: the fields its core attention reads, with
    its defaults (``__post_init__``'s fallbacks applied in :func:`fleet_config`)."""


def fleet_config(**fields: Any) -> FleetConfig:
    c: dict[str, Any] = {
        "vocab_size": 64,
        "hidden_size": 32,
        "ffn_hidden_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": None,
        "head_dim": None,
        "v_head_dim": None,
        "softmax_scale": None,
        "softmax_type": "vanilla",
        "add_full_attention_sink_bias": False,
        "add_swa_attention_sink_bias": True,
        "sliding_window": None,
        "window_attn_skip_freq": None,
        "head_wise_swa_ratio": 0.0,
        "swa_num_attention_heads": None,
        "swa_num_key_value_heads": None,
        "swa_head_dim": None,
        "swa_v_head_dim": None,
        "rope_theta": 10000.0,
        "swa_rope_theta": None,
        "multi_latent_attention": False,
        "q_lora_rank": None,
        "kv_lora_rank": None,
        "qk_nope_head_dim": None,
        "qk_rope_head_dim": None,
        "rotary_scaling_factor": 1.0,
        "mscale_all_dim": 0.0,
        "num_empty_layers_add_in_head": 0,
        "mtp_num_layers": 0,
        # read by DotProductAttention / FusedScaleMaskSoftmax
        "_attn_implementation": "flashmask",
        "fp16": False,
        "bf16": False,
        "masked_softmax_fusion": False,
        "attention_softmax_in_fp32": True,
        "apply_query_key_layer_scaling": False,
        "attention_dropout": 0.0,
        "params_dtype": "float32",
        "perform_initialization": True,
        "init_method": _init_normal,
        "flashmask_use_varlen": False,
        "cp_balance_mode": None,
        "gpt_model_use_experimental_version": False,
        "use_accuracy_compatible": False,
        "layernorm_epsilon": 1e-6,
    }
    unknown = set(fields) - set(c) - {"layer_types", "use_sliding_window"}
    if unknown:
        raise ValueError(f"unknown config fields {sorted(unknown)}")
    c.update(fields)
    c["num_key_value_heads"] = c["num_key_value_heads"] or c["num_attention_heads"]
    c["head_dim"] = c["head_dim"] or c["hidden_size"] // c["num_attention_heads"]
    c["v_head_dim"] = c["v_head_dim"] or c["head_dim"]
    c["swa_num_attention_heads"] = c["swa_num_attention_heads"] or c["num_attention_heads"]
    c["swa_num_key_value_heads"] = c["swa_num_key_value_heads"] or c["num_key_value_heads"]
    c["swa_head_dim"] = c["swa_head_dim"] or c["head_dim"]
    c["swa_v_head_dim"] = c["swa_v_head_dim"] or c["v_head_dim"]
    c["swa_rope_theta"] = c["swa_rope_theta"] or c["rope_theta"]
    return FleetConfig(**c)


def _rope(x: paddle.Tensor, positions: paddle.Tensor, theta: float) -> paddle.Tensor:
    from fastdeploy_paddlefleet.minifleet.attention import rotate_half_rope

    return rotate_half_rope(x, positions, theta)


class SelfAttention(paddle.nn.Layer):
    """PaddleFleet's ``Attention.__init__`` choices (is_swa, heads, dims) around the real core attention."""

    def __init__(self, hm: HostModules, config: FleetConfig, layer_number: int, is_mtp_layer: bool) -> None:
        super().__init__()
        c = config
        self.config = c
        self.layer_number = layer_number
        self.attn_mask_type = hm.AttnMaskType.causal
        self.is_swa = False
        if c.sliding_window is not None:
            if is_mtp_layer:
                for_swa = layer_number + c.num_hidden_layers
            else:
                for_swa = layer_number - c.num_empty_layers_add_in_head
            self.is_swa = bool(
                hm.utils.is_layer_window_attention(c.sliding_window, c.window_attn_skip_freq, for_swa)
            )
        if self.is_swa:
            hq, hkv, d, dv, theta = (
                c.swa_num_attention_heads,
                c.swa_num_key_value_heads,
                c.swa_head_dim,
                c.swa_v_head_dim,
                c.swa_rope_theta,
            )
        else:
            hq, hkv, d, dv, theta = (
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim,
                c.v_head_dim,
                c.rope_theta,
            )
        self.shape = (hq, hkv, d, dv)
        self.theta = theta
        h = c.hidden_size
        self.qkv_proj = paddle.nn.Linear(h, hq * d + hkv * d + hkv * dv, bias_attr=False)
        self.core_attention = hm.DotProductAttention(
            config=c,
            layer_number=layer_number,
            attn_mask_type=self.attn_mask_type,
            attention_type="self",
            is_mtp_layer=is_mtp_layer,
            is_swa=self.is_swa,
            k_channels=d,
            v_channels=dv,
            num_attention_heads=hq,
            num_key_value_heads=hkv,
            cp_comm_type=None,
            softmax_scale=c.softmax_scale,
            pg_collection=None,
        )
        self._real = type(self.core_attention)
        self.o_proj = paddle.nn.Linear(hq * dv, h, bias_attr=False)

    def qkv(self, x: paddle.Tensor, positions: paddle.Tensor) -> tuple[paddle.Tensor, ...]:
        b, s, _ = x.shape
        hq, hkv, d, dv = self.shape
        q, k, v = paddle.split(self.qkv_proj(x), [hq * d, hkv * d, hkv * dv], axis=-1)
        q = _rope(q.reshape([b, s, hq, d]), positions, self.theta)
        k = _rope(k.reshape([b, s, hkv, d]), positions, self.theta)
        return q, k, v.reshape([b, s, hkv, dv])

    def forward(self, x: paddle.Tensor, positions: paddle.Tensor, mask: Any, rows: Any) -> paddle.Tensor:
        q, k, v = self.qkv(x, positions)
        if rows is not None and type(self.core_attention) is self._real:
            q = Bf16Label(q)  # the real FlashMask branch, in fp32 (module doc)
        out = self.core_attention(
            q,
            k,
            v,
            mask,
            rows,
            attn_mask_type=self.attn_mask_type,
            attention_bias=None,
            packed_seq_params=None,
            use_rr_flash_attention=False,
        )
        return self.o_proj(out)


class MLASelfAttention(SelfAttention):
    """PaddleFleet's ``MultiLatentAttention``: core attention built without ``is_swa`` and without
    ``num_key_value_heads`` (so it reports the config's kv heads), scale ``mscale**2 / sqrt(qk)``;
    K/V carry one head per query head."""

    def __init__(self, hm: HostModules, config: FleetConfig, layer_number: int, is_mtp_layer: bool) -> None:
        paddle.nn.Layer.__init__(self)
        c = config
        self.config = c
        self.layer_number = layer_number
        self.attn_mask_type = hm.AttnMaskType.causal
        self.is_swa = False
        hq, nope, rope, dv = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.dims = (hq, nope, rope, dv)
        self.theta = c.rope_theta
        h = c.hidden_size
        f = c.rotary_scaling_factor
        mscale = 0.1 * c.mscale_all_dim * math.log(f) + 1.0 if f > 1.0 else 1.0
        self.q_proj = paddle.nn.Linear(h, hq * (nope + rope), bias_attr=False)
        self.kv_down_proj = paddle.nn.Linear(h, c.kv_lora_rank + rope, bias_attr=False)
        self.kv_up_proj = paddle.nn.Linear(c.kv_lora_rank, hq * (nope + dv), bias_attr=False)
        self.core_attention = hm.DotProductAttention(
            config=c,
            layer_number=layer_number,
            attn_mask_type=self.attn_mask_type,
            attention_type="self",
            softmax_scale=mscale * mscale / math.sqrt(nope + rope),
            k_channels=nope + rope,
            v_channels=dv,
            cp_comm_type=None,
            pg_collection=None,
        )
        self._real = type(self.core_attention)
        self.o_proj = paddle.nn.Linear(hq * dv, h, bias_attr=False)

    def qkv(self, x: paddle.Tensor, positions: paddle.Tensor) -> tuple[paddle.Tensor, ...]:
        b, s, _ = x.shape
        hq, nope, rope, dv = self.dims
        q = self.q_proj(x).reshape([b, s, hq, nope + rope])
        latent, k_pe = paddle.split(self.kv_down_proj(x), [self.config.kv_lora_rank, rope], axis=-1)
        kv = self.kv_up_proj(latent).reshape([b, s, hq, nope + dv])
        q_pe = _rope(q[..., nope:], positions, self.theta)
        k_pe = _rope(k_pe.reshape([b, s, 1, rope]), positions, self.theta).expand([b, s, hq, rope])
        q = paddle.concat([q[..., :nope], q_pe], axis=-1)
        k = paddle.concat([kv[..., :nope], k_pe], axis=-1)
        return q, k, kv[..., nope:]


class TransformerLayer(paddle.nn.Layer):
    """Pre-norm block; ``layer_number`` as PaddleFleet's layer specs give it (decoder: index plus
    the empty head layers; MTP: its own index)."""

    def __init__(self, hm: HostModules, config: FleetConfig, layer_number: int, is_mtp_layer: bool = False):
        super().__init__()
        from fastdeploy_paddlefleet.minifleet.norm import RMSNorm

        h, f = config.hidden_size, config.ffn_hidden_size
        self.input_layernorm = RMSNorm(h, config.layernorm_epsilon)
        attn = MLASelfAttention if config.multi_latent_attention else SelfAttention
        self.self_attn = attn(hm, config, layer_number, is_mtp_layer)
        self.post_attention_layernorm = RMSNorm(h, config.layernorm_epsilon)
        self.up_gate_proj = paddle.nn.Linear(h, 2 * f, bias_attr=False)
        self.down_proj = paddle.nn.Linear(f, h, bias_attr=False)

    def forward(self, x: dict[str, Any]) -> dict[str, Any]:
        h = x["hidden_states"]
        h = h + self.self_attn(
            self.input_layernorm(h),
            x["position_ids"],
            x["attention_mask"],
            x["attn_mask_startend_row_indices"],
        )
        gate, up = paddle.chunk(self.up_gate_proj(self.post_attention_layernorm(h)), 2, axis=-1)
        return {**x, "hidden_states": h + self.down_proj(F.silu(gate) * up)}


class _Embedding(paddle.nn.Layer):
    def __init__(self, config: FleetConfig) -> None:
        super().__init__()
        self.word_embeddings = paddle.nn.Embedding(config.vocab_size, config.hidden_size)

    def forward(self, x: dict[str, Any]) -> dict[str, Any]:
        return {**x, "hidden_states": self.word_embeddings(x["input_ids"])}


class _Empty(paddle.nn.Layer):
    def forward(self, x: dict[str, Any]) -> dict[str, Any]:
        return x


class _MTP(paddle.nn.Layer):
    def __init__(self, hm: HostModules, config: FleetConfig, index: int) -> None:
        super().__init__()
        self.eh_proj = paddle.nn.Linear(config.hidden_size, config.hidden_size, bias_attr=False)
        self.transformer_layer = TransformerLayer(hm, config, index, is_mtp_layer=True)

    def forward(self, x: dict[str, Any]) -> dict[str, Any]:
        inner = self.transformer_layer({**x, "hidden_states": self.eh_proj(x["hidden_states"])})
        return {**x, "mtp_sum": x.get("mtp_sum", 0.0) + inner["hidden_states"]}


class _Head(paddle.nn.Layer):
    def __init__(self, config: FleetConfig) -> None:
        super().__init__()
        from fastdeploy_paddlefleet.minifleet.norm import RMSNorm

        self.norm = RMSNorm(config.hidden_size, config.layernorm_epsilon)
        self.weight = self.create_parameter([config.hidden_size, config.vocab_size], dtype="float32")

    def forward(self, x: dict[str, Any]) -> dict[str, Any]:
        h = self.norm(x["hidden_states"]) + x.get("mtp_sum", 0.0)
        return {**x, "logits": paddle.matmul(h, self.weight)}


class _FinalNorm(paddle.nn.Layer):
    def __init__(self, config: FleetConfig) -> None:
        super().__init__()
        from fastdeploy_paddlefleet.minifleet.norm import RMSNorm

        self.norm = RMSNorm(config.hidden_size, config.layernorm_epsilon)

    def forward(self, x: dict[str, Any]) -> dict[str, Any]:
        return {**x, "hidden_states": self.norm(x["hidden_states"])}


class TinyFleetGPT(paddle.nn.Layer):
    """Embedding, empty head layers, decoder layers, final norm, MTP layers, LM head: ``run_function``."""

    def __init__(self, hm: HostModules, config: FleetConfig) -> None:
        super().__init__()
        self.config = config
        n, empty = config.num_hidden_layers, config.num_empty_layers_add_in_head
        self.embedding = _Embedding(config)
        self.layers = paddle.nn.LayerList([TransformerLayer(hm, config, i + empty) for i in range(n)])
        self.final_norm = _FinalNorm(config)
        self.mtp = paddle.nn.LayerList([_MTP(hm, config, k) for k in range(config.mtp_num_layers)])
        self.lm_head = _Head(config)
        self.run_function = [
            self.embedding,
            *[_Empty() for _ in range(empty)],
            *self.layers,
            self.final_norm,
            *self.mtp,
            self.lm_head,
        ]


def build_model(hm: HostModules, config: FleetConfig, seed: int = 0) -> TinyFleetGPT:
    """A :class:`TinyFleetGPT` with deterministic weights (by parameter name and ``seed``), eval mode."""
    from fastdeploy_paddlefleet.minifleet import init_weights

    model = TinyFleetGPT(hm, config)
    init_weights(model, seed)
    model.eval()
    return model
