"""``PaddleFleetForCausalLM``: the FastDeploy model class for PaddleFleet models.

FastDeploy builds it with ``PaddleFleetForCausalLM(fd_config)``, loads weights
(``load_weights`` / ``set_state_dict``), then per step calls
``forward(inputs, forward_meta)`` over the packed tokens of the batch
(``inputs["ids_remove_padding"] [T]``) and ``compute_logits(hidden [T, h])``.

What it wraps is a PaddleFleet-shaped ``GPTModel`` (``run_function``:
embedding, transformer layers, final norm, LM head; dicts between layers)
whose core attentions were patched to run on FastDeploy's paged KV cache:

* ``model_type == "minifleet"`` configs (the embedded ``tiny`` presets) build
  ``minifleet``; every other config builds PaddleFleet through PaddleFormers,
  which needs the ``paddlefleet`` package (a clear ``ImportError`` otherwise);
* :meth:`PaddleFleetForCausalLM.from_model` wraps an already built model
  (tests, the embedded model, ``fdfleet``).

Per step the forward converts FastDeploy's ``ForwardMeta`` into the plugin's
``BatchMeta`` (same field names), pairs the flat cache list
``[k0, v0, k1, v1, ...]`` per layer, computes each packed token's absolute
position ``seq_lens_decoder[b] + (t - cu_seqlens_q[b])``, and enters a
``StepContext`` on the model's holder while the layers run.

Head-wise KV (``FDFLEET_HEADWISE_KV=1``): the cache pages belong to
FastDeploy's scheduler, not to the model. When it runs head-wise (a
:class:`~fastdeploy_paddlefleet.kvcache.headwise.HeadwiseKVManager` at the
integration point of ``docs/kvcache.md``) it hands ``forward_meta.
block_tables_headwise`` (one ``[bsz * Hkv, max_pages]`` table, or a mapping
``layer index -> table``), which :func:`batch_meta_from_forward_meta` carries
into ``BatchMeta`` and every backend reads per layer whenever it is there,
switch or not (pages allocated per head cannot be read through
``block_tables``). The switch is parsed when the model is built (a bad value
fails at load, naming the variable) and states the expectation: with it on, a
step without head-wise tables logs one warning (attention then reads
``block_tables``: correct, but no page is recycled). ``fdfleet verify
--headwise-kv`` runs the whole path on the manager's tables.

Quantized KV cache (``kv_cache_quant_type``: ``block_wise_fp8``, ``float8_e4m3fn``, ``int8``; a
quantization config with nothing else, ``serving/checks.py``): each layer's cache reaches the
backend as a ``QuantizedKVCache`` (``serving/cache_views.py``); a static format's scales come from
the checkpoint (``serving/kv_scales.py``), taken out of the weights before they are assigned.

Idle expert-parallel rank: with zero tokens and expert parallelism on, the
other ranks' MoE layers still wait for this rank's collectives. The forward
then runs ONE fake token through every layer — attention on a private
one-block scratch cache with a throwaway batch, never the real cache — so
each MoE layer joins its exchange, and returns ``[0, hidden]``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import paddle

from ..adapter.context import StepContext, StepContextHolder
from ..backends import AttentionBackend, BatchMeta
from ..backends.base import host_int
from ..backends.checks import check_token_ids
from ..backends.deferred_errors import DeferredErrorCheck
from ..plan.layer import AttentionPlan
from ._fields import field as _get
from .build import build_from_fd_config, resolve_backend
from .forward_meta import batch_meta_from_forward_meta, layer_caches, packed_positions
from .names import ARCHITECTURE, RL_ARCHITECTURE
from .weights import assign_weights

logger = logging.getLogger(__name__)

_GRAPH_STEP_CLASS: Any = None


def _graph_step_layer(fd_config: Any, owner: PaddleFleetForCausalLM) -> paddle.nn.Layer | None:
    """One step of ``owner`` inside FastDeploy's graph optimization (``support_graph_optimization``:
    CUDA graph capture and replay of decode steps), or ``None`` without FastDeploy or its config."""
    global _GRAPH_STEP_CLASS
    if _get(fd_config, "graph_opt_config") is None:
        return None
    try:
        from fastdeploy.model_executor.graph_optimization.decorator import support_graph_optimization
    except ImportError:
        return None
    if _GRAPH_STEP_CLASS is None:

        class PaddleFleetStep(paddle.nn.Layer):
            """Runs ``owner._step(ids_remove_padding, forward_meta)``; holds no parameters."""

            def __init__(self, fd_config: Any, owner: Any) -> None:
                super().__init__()
                object.__setattr__(self, "_owner", owner)  # not a sublayer: no cycle

            def forward(self, ids_remove_padding: paddle.Tensor, forward_meta: Any) -> paddle.Tensor:
                return self._owner._step(ids_remove_padding, forward_meta)

        _GRAPH_STEP_CLASS = support_graph_optimization(PaddleFleetStep)
    return _GRAPH_STEP_CLASS(fd_config=fd_config, owner=owner)


class PaddleFleetForCausalLM(paddle.nn.Layer):
    """FastDeploy's model class around a patched PaddleFleet-shaped ``GPTModel``.

    Shapes: ``forward`` takes ``inputs["ids_remove_padding"] [T]`` and returns
    hidden states ``[T, hidden]``; ``compute_logits`` maps ``[T, hidden]`` to
    ``[T, vocab]`` float32.
    """

    #: test hook: with zero tokens, return at once even under expert parallelism
    #: (what a naive model does; the other ranks then hang in their MoE exchange)
    idle_early_return: bool = False

    def __init__(self, fd_config: Any) -> None:
        from .checks import check_fd_config

        check_fd_config(fd_config, self.name())  # loader / quantization refused here, naming the setting
        super().__init__()
        self.fd_config = fd_config
        model, plan, preloaded = build_from_fd_config(fd_config)
        pc = _get(fd_config, "parallel_config")
        ep = int(_get(pc, "expert_parallel_size") or 1) > 1 or bool(_get(pc, "use_ep"))
        cache_config = _get(fd_config, "cache_config")
        from .parallel import parallel_setup

        ep_group = parallel_setup(fd_config).ep_group  # FastDeploy's expert-parallel group (or None)
        self._attach(model, plan, None, ep_group, _get(cache_config, "block_size"), expert_parallel=ep)
        from .checks import kv_cache_quant_of

        self._set_kv_cache_quant(kv_cache_quant_of(fd_config, self.name()))
        self._weights_preloaded = preloaded
        mc = _get(fd_config, "model_config")
        self._ori_vocab_size = _get(mc, "ori_vocab_size")
        self._check_fastdeploy_caches(fd_config)
        if hasattr(self.backend, "host_checks"):  # served: no host copy of the metadata (CUDA graphs)
            self.backend.host_checks = False
        spec = _get(fd_config, "speculative_config")
        if _get(spec, "method") is not None:  # a decode step holds 1 + draft tokens per request
            drafts = _get(spec, "num_speculative_tokens")
            self._decode_tokens = 1 + (
                0 if drafts is None else host_int("speculative_config.num_speculative_tokens", drafts, 0)
            )
        # a plain attribute, not a sublayer (a class-level default would shadow a registered sublayer)
        object.__setattr__(self, "_graph_step", _graph_step_layer(fd_config, self))

    def _check_fastdeploy_caches(self, fd_config: Any) -> None:
        """Refuse cache layouts the attention cannot read; warn when FastDeploy's cache shape was sized
        before this load could fit it to every layer (see ``serving/cache_views.py``)."""
        from .cache_views import check_fastdeploy_cache_settings, fit_fastdeploy_model_config

        check_fastdeploy_cache_settings(fd_config)
        mc = _get(fd_config, "model_config")
        changes = fit_fastdeploy_model_config(mc)
        if changes:
            logger.warning(
                "FastDeploy's model config was not sized for every layer when it was built (%s); a runner "
                "that sized its attention backend before this load allocates caches too small for some "
                "layers, and the forward will refuse them. The plugin's registry routing fits the config "
                "when FastDeploy builds it: select the model with --model-impl paddlefleet",
                ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changes.items()),
            )

    @classmethod
    def name(cls) -> str:
        return ARCHITECTURE

    @classmethod
    def from_model(
        cls,
        model: paddle.nn.Layer,
        plan: AttentionPlan,
        backend: str | AttentionBackend | None = None,
        ep_group: Any = None,
        block_size: int | None = None,
        kv_cache_quant: Any = None,
    ) -> PaddleFleetForCausalLM:
        """Wrap an already built ``GPTModel`` (minifleet or PaddleFleet), patching it in place.

        ``backend``: a name (``auto``/``reference``/``triton``), an instance,
        or ``None`` for ``FDFLEET_BACKEND``. ``ep_group``: the expert-parallel
        group handed to every MoE layer (``set_ep_group``). ``block_size``:
        default for steps whose metadata does not say it. ``kv_cache_quant``: FastDeploy's
        ``kv_cache_quant_type`` of the caches the steps bring (``None``: unquantized).
        """
        from ..kvcache.layout import cache_quant

        self = cls.__new__(cls)
        paddle.nn.Layer.__init__(self)
        self.fd_config = None
        self._attach(model, plan, backend, ep_group, block_size, expert_parallel=ep_group is not None)
        self._set_kv_cache_quant(cache_quant(kv_cache_quant))
        self._weights_preloaded = False
        self._ori_vocab_size = None
        return self

    #: the KV cache format (``kvcache.quant.KVCacheQuant``; None: unquantized)
    kv_quant: Any = None
    #: a static format's per-layer dequant scales (``kv_scales.StaticKVScales``), None otherwise
    kv_scales: Any = None

    def _set_kv_cache_quant(self, quant: Any) -> None:
        """Record the cache format; a static one gets a scale store keyed by the layers' prefixes."""
        self.kv_quant = quant
        self.kv_scales = None
        if quant is not None and not quant.dynamic:
            from .kv_scales import StaticKVScales

            suffix = ".core_attention"
            prefixes = {
                p.layer_index: p.name[: -len(suffix)] if p.name.endswith(suffix) else p.name
                for p in self.patch_report.patched
            }
            self.kv_scales = StaticKVScales(prefixes, quant)
        if quant is not None:
            logger.info("PaddleFleetForCausalLM: %s KV cache", quant.name)

    #: most query tokens of one request in a decode-only step (1 + speculative draft tokens)
    _decode_tokens: int = 1
    #: FastDeploy's graph-optimization wrapper around one step (None: eager, no FastDeploy)
    _graph_step: Any = None

    def clear_graph_opt_backend(self, fd_config: Any = None) -> None:
        """Drop the captured CUDA graphs (FastDeploy calls it on sleep / ``clear_parameters``)."""
        step = self._graph_step
        backend = getattr(step, "graph_opt_backend", None)
        if backend is None or getattr(backend, "cudagraph_piecewise_backend", None) is None:
            return  # eager, or nothing captured yet
        step.clear_graph_opt_backend(fd_config=fd_config if fd_config is not None else self.fd_config)

    def _attach(
        self,
        model: paddle.nn.Layer,
        plan: AttentionPlan,
        backend: str | AttentionBackend | None,
        ep_group: Any,
        block_size: int | None,
        *,
        expert_parallel: bool,
    ) -> None:
        from ..patch import patch_core_attention

        if not isinstance(plan, AttentionPlan):
            raise TypeError(f"plan must be an AttentionPlan, got {type(plan).__name__}")
        run_function = list(getattr(model, "run_function", None) or [])
        if len(run_function) < 2:
            raise ValueError(
                "model must expose a PaddleFleet run_function (embedding ... LM head), "
                f"got {len(run_function)} layers"
            )
        self.model = model
        self.plan = plan
        self.block_size = None if block_size is None else host_int("block_size", block_size, 1)
        vocab = _get(getattr(model, "config", None), "vocab_size")
        #: rows of the embedding: token ids at or past it (or below 0) are refused where the host holds them
        self._vocab_size = None if vocab is None else host_int("model config vocab_size", vocab, 1)
        self.backend = resolve_backend(backend)
        self.holder = StepContextHolder()
        #: the kernels' device error flags, read one step late (no sync in the serving loop)
        self._kernel_errors = DeferredErrorCheck(self.backend)
        self.patch_report = patch_core_attention(model, plan, self.backend, holder=self.holder)
        from ..envs import headwise_kv

        #: FDFLEET_HEADWISE_KV: the host's scheduler is expected to pass head-wise page tables
        self.headwise_kv = headwise_kv()
        self._warned_no_headwise = False
        moe_layers = [layer for layer in model.sublayers() if hasattr(layer, "set_ep_group")]
        if ep_group is not None:
            for layer in moe_layers:
                layer.set_ep_group(ep_group)
        self.expert_parallel = expert_parallel or any(int(getattr(m, "ep_size", 1)) > 1 for m in moe_layers)
        self._scratch: tuple[BatchMeta, list[tuple[Any, Any]]] | None = None
        logger.info(
            "PaddleFleetForCausalLM: %d attention layers patched (%s backend), %d skipped, "
            "expert parallel: %s",
            self.patch_report.num_patched,
            self.backend.name,
            len(self.patch_report.skipped),
            self.expert_parallel,
        )

    # -- shapes and dtypes --------------------------------------------------------------------
    @property
    def hidden_size(self) -> int:
        config = getattr(self.model, "config", None)
        size = _get(config, "hidden_size") or _get(_get(self.fd_config, "model_config"), "hidden_size")
        if not size:
            raise ValueError("cannot tell the hidden size: the model config has no hidden_size")
        return int(size)

    @property
    def dtype(self) -> Any:
        for p in self.model.parameters():
            return p.dtype
        return paddle.float32

    # -- the step ---------------------------------------------------------------------------
    def _run_body(self, ids: paddle.Tensor, positions: paddle.Tensor) -> paddle.Tensor:
        """Every layer but the LM head over ``ids [1, T]`` -> hidden ``[T, h]``."""
        carry: Any = {
            "input_ids": ids,
            "position_ids": positions,
            "attention_mask": None,
            "attn_mask_startend_row_indices": None,
        }
        for layer in self.model.run_function[:-1]:
            carry = layer(carry)
        hidden = carry["hidden_states"] if isinstance(carry, Mapping) else carry
        return hidden.reshape([int(ids.shape[1]), hidden.shape[-1]])

    @paddle.no_grad()
    def forward(self, inputs: Mapping[str, Any], forward_meta: Any, **kwargs: Any) -> paddle.Tensor:
        """``inputs["ids_remove_padding"] [T]`` + FastDeploy's ``forward_meta`` -> hidden ``[T, hidden]``.

        Extra keyword arguments some FastDeploy versions pass are ignored.
        """
        ids = _get(inputs, "ids_remove_padding")
        if ids is None:
            raise ValueError("inputs['ids_remove_padding'] is required (the packed token ids [T]), got None")
        if ids.ndim == 2 and int(ids.shape[0]) == 1:
            ids = ids.reshape([-1])
        if ids.ndim != 1:
            raise ValueError(f"inputs['ids_remove_padding'] must be [T], got shape {list(ids.shape)}")
        # the dtype always (a float would be truncated by the cast); values where the host holds them
        check_token_ids("inputs['ids_remove_padding']", ids, self._vocab_size)
        num_tokens = int(ids.shape[0])
        if num_tokens == 0 or bool(_get(forward_meta, "is_zero_size")):
            return self._idle_forward()
        if self._graph_step is not None:  # FastDeploy's graph optimization: CUDA graphs for decode steps
            hidden = self._graph_step(ids_remove_padding=ids, forward_meta=forward_meta)
        else:
            hidden = self._step(ids, forward_meta)
        self._kernel_errors.snapshot()  # outside the captured region; read at the next compute_logits
        return hidden

    def _step(self, ids: paddle.Tensor, forward_meta: Any) -> paddle.Tensor:
        """One step over ``ids [T]``: no host synchronisation (FastDeploy may capture it in a CUDA graph)."""
        num_tokens = int(ids.shape[0])
        meta = batch_meta_from_forward_meta(forward_meta, self.block_size, num_tokens, self._decode_tokens)
        if self.headwise_kv and meta.block_tables_headwise is None and not self._warned_no_headwise:
            self._warned_no_headwise = True
            logger.warning(
                "FDFLEET_HEADWISE_KV is on but forward_meta has no block_tables_headwise: the scheduler "
                "does not run head-wise; attention reads block_tables and no page is recycled"
            )
        caches = layer_caches(_get(forward_meta, "caches"), self.plan, self.kv_quant, self.kv_scales)
        positions = packed_positions(meta, num_tokens)
        with self.holder.step(StepContext(meta, caches, positions)):
            return self._run_body(ids.astype("int64").reshape([1, num_tokens]), positions.reshape([1, -1]))

    def _idle_forward(self) -> paddle.Tensor:
        """No tokens here: take part in the MoE exchanges if they need us, then return ``[0, hidden]``."""
        if self.expert_parallel and not self.idle_early_return:
            meta, caches = self._scratch_step()
            zero = paddle.zeros([1], dtype="int64")
            with self.holder.step(StepContext(meta, caches, zero)):
                hidden = self._run_body(paddle.zeros([1, 1], dtype="int64"), zero.reshape([1, 1]))
            return hidden[:0]
        return paddle.zeros([0, self.hidden_size], dtype=self.dtype)

    def _scratch_step(self) -> tuple[BatchMeta, list[tuple[Any, Any]]]:
        """A one-token prefill batch on a private one-block cache per layer (built once)."""
        if self._scratch is None:
            from ..patch import cache_plan

            block = self.block_size or 16
            caches = []
            for layer in cache_plan(self.plan, self.backend):  # V padded where the backend needs it
                shape = [1, layer.num_kv_heads, block]
                caches.append(
                    (
                        paddle.zeros(shape + [layer.qk_head_dim], dtype=self.dtype),
                        paddle.zeros(shape + [layer.v_head_dim], dtype=self.dtype),
                    )
                )
            one = paddle.ones([1], dtype="int32")
            meta = BatchMeta(
                seq_lens_encoder=one,
                seq_lens_decoder=paddle.zeros([1], dtype="int32"),
                seq_lens_this_time=one,
                cu_seqlens_q=paddle.to_tensor([0, 1], dtype="int32"),
                batch_id_per_token=paddle.zeros([1], dtype="int32"),
                block_tables=paddle.zeros([1, 1], dtype="int32"),
                block_size=block,
                max_seq_len_this_time=1,
                max_context_len=1,
            )
            self._scratch = (meta, caches)
        return self._scratch

    @paddle.no_grad()
    def compute_logits(self, hidden_states: paddle.Tensor, forward_meta: Any = None) -> paddle.Tensor:
        """LM head: ``hidden_states [T, hidden]`` -> logits ``[T, vocab]`` float32.

        First reports a bad block-table entry the kernels recorded in the previous step's forward (whose
        output FastDeploy has synchronised since): ``ValueError`` naming request, logical block and
        value; no sync otherwise (``backends/deferred_errors.py``)."""
        self._kernel_errors.check()
        if hidden_states.ndim != 2:
            raise ValueError(f"hidden_states must be [T, hidden], got shape {list(hidden_states.shape)}")
        tokens = int(hidden_states.shape[0])
        out = self.model.run_function[-1]({"hidden_states": hidden_states.unsqueeze(0)})
        logits = out["logits"] if isinstance(out, Mapping) else out
        logits = logits.reshape([tokens, logits.shape[-1]]).astype("float32")
        if self._ori_vocab_size and int(self._ori_vocab_size) < int(logits.shape[-1]):
            # padded vocab rows are never sampled
            logits[:, int(self._ori_vocab_size) :] = float("-inf")
        return logits

    # -- weights ----------------------------------------------------------------------------
    def set_state_dict(self, state_dict: Mapping[str, Any]) -> list[str]:
        """Load ``{name: array or tensor}`` into the host model; returns the names not given.

        Names are the host model's own (``decoder.layers.1.self_attn.core_attention.softmax_offset``),
        optionally prefixed ``model.``. Unknown names or wrong shapes raise ``ValueError``.
        """
        state_dict = self._take_cache_scales(state_dict)
        if self._weights_preloaded:  # FastDeploy's v0 loader calls this with the checkpoint it read
            logger.info("set_state_dict: weights were loaded by PaddleFormers from_pretrained; skipping")
            self._finish_cache_scales()
            return []
        missing = assign_weights(self.model, state_dict)
        self._finish_cache_scales()
        return missing

    def _take_cache_scales(self, state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
        """``state_dict`` without FastDeploy's static KV cache tensors (the model has no parameter for
        them): a static format keeps the scales, otherwise they are dropped with a log line."""
        from .kv_scales import is_cache_scale_name

        if not any(is_cache_scale_name(n) for n in state_dict):
            return state_dict
        rest = dict(state_dict)
        if self.kv_scales is not None:
            self.kv_scales.take(rest)
        else:
            names = [n for n in rest if is_cache_scale_name(n)]
            for n in names:
                rest.pop(n)
            logger.info(
                "%d static KV cache scale tensors in the checkpoint are not used (kv_cache_quant_type=%s)",
                len(names),
                None if self.kv_quant is None else self.kv_quant.name,
            )
        return rest

    def _finish_cache_scales(self) -> None:
        """A static format's scales as dequant multipliers (``ValueError`` naming a missing tensor)."""
        if self.kv_scales is not None:
            self.kv_scales.finish(self.plan, self.dtype)

    def load_weights(self, weights_iterator: Iterable[tuple[str, Any]]) -> list[str]:
        """FastDeploy's loader: ``(name, array or tensor)`` pairs, same names as :meth:`set_state_dict`.

        A PaddleFleet model built by PaddleFormers' ``from_pretrained`` already holds its
        checkpoint: the iterator is not consumed then.
        """
        if self._weights_preloaded:
            if self.kv_scales is not None:  # the static cache scales are not PaddleFormers' to load
                self.kv_scales.take_from(weights_iterator)
                self._finish_cache_scales()
            logger.info("load_weights: weights were loaded by PaddleFormers from_pretrained; skipping")
            return []
        return self.set_state_dict(dict(weights_iterator))


class PaddleFleetForCausalLMRL(PaddleFleetForCausalLM):
    """The name FastDeploy's loaders build under ``dynamic_load_weight`` (RL): refused with a message.

    Registered so that the lookup of ``PaddleFleetForCausalLMRL`` finds this class and the
    error names the RL loader instead of "not registered".
    """

    def __init__(self, fd_config: Any) -> None:
        from .checks import check_loader

        check_loader(fd_config, ARCHITECTURE)
        raise ValueError(
            f"{self.name()}: FastDeploy's RL loader (load_config.dynamic_load_weight) is not supported "
            "by the paddlefleet plugin; serve without --dynamic-load-weight"
        )

    @classmethod
    def name(cls) -> str:
        return RL_ARCHITECTURE
