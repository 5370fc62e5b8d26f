"""Registration with an installed FastDeploy (called by ``plugin.register*()``).

Two entry points, both idempotent (see ``docs/fastdeploy.md``):

* :func:`register_model_impl` runs at ``import fastdeploy`` (this package's entry
  point in the ``fastdeploy.tool_parser_plugins`` and
  ``fastdeploy.reasoning_parser_plugins`` groups, which FastDeploy loads while
  ``fastdeploy/__init__.py`` imports ``LLM``): it makes ``--model-impl
  paddlefleet`` parseable before the api_server builds its parser at import.
  It touches only ``fastdeploy.engine.args_utils`` and ``fastdeploy.config``
  (already imported by then), never the model package.
* :func:`register_with_fastdeploy` runs from ``fastdeploy.model_register_plugins``
  (loaded at the end of ``fastdeploy/model_executor/models/__init__.py``, after
  FastDeploy registered its own models): the above plus the architecture and
  the routing.

What is done:

1. **``paddlefleet`` as a model-impl.** FastDeploy versions list the accepted
   values in several places: a module constant, the ``--model-impl`` argparse
   ``choices`` of ``EngineArgs.add_cli_args``, and a list local to
   ``EngineArgs.__post_init__`` (and the worker's own CLI, which only ever sees
   what the engine passes on). Module constants are extended in place,
   ``add_cli_args`` is wrapped to extend the built parser's choices, and
   ``__post_init__`` is wrapped so ``paddlefleet`` passes: the choice is recorded
   in ``FDFLEET_MODEL_IMPL=paddlefleet`` (inherited by the worker processes
   FastDeploy spawns) and FastDeploy's own checks and worker CLI see ``auto``.
   FastDeploy versions that know ``paddlefleet`` themselves (PR #7964 on) get the
   same treatment, so their in-tree fleet paths never engage for this model.
2. **Architecture.** ``PaddleFleetForCausalLM`` is registered under its
   ``name()`` with this package's module path. When FastDeploy already has a
   class of that name (its in-tree fleet fallback, #7964 on), ours replaces it in
   the registry for this process and one INFO line says which class was set
   aside: the plugin is only loaded when ``FD_PLUGINS`` lists it. Only that
   name: PaddleFormers' fleet-backed architectures (``Qwen3ForCausalLM``, ...)
   are not registered, FastDeploy's native classes stay. ``PaddleFleetForCausalLMRL``
   (what the RL loader looks up) is registered too and refuses at build with a
   message naming the loader.
3. **Routing.** The registry's per-config lookups (``inspect_model_cls``,
   ``is_text_generation_model``, ...) are wrapped: when the model config's
   ``model_impl`` is ``paddlefleet`` (or ``FDFLEET_MODEL_IMPL`` says so) they
   answer for ``PaddleFleetForCausalLM``; ``ModelConfig._post_init`` (which
   keeps only the resolved name) is wrapped so ``model_config.architectures``
   ends ``[PaddleFleetForCausalLM, <the checkpoint's own names>...]`` (the
   loaders build ``ModelRegistry.get_class(architectures[0])``).

Signatures drift between FastDeploy versions: every call passes only the
keyword arguments the installed function accepts.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .names import ARCHITECTURE, MODEL_IMPL, MODEL_IMPL_ENV, MODULE_NAME, MODULE_PATH, RL_ARCHITECTURE
from .names import wants_paddlefleet as _wants_paddlefleet

logger = logging.getLogger(__name__)

_REGISTRY_MODULES = ("fastdeploy.model_executor.models.model_base", "fastdeploy.model_executor.models")
_ARGS_MODULES = ("fastdeploy.engine.args_utils", "fastdeploy.config", "fastdeploy.worker.worker_process")
#: imported by the early hook only when already imported (the worker module is heavy, and sees ``auto``)
_LATE_ARGS_MODULES = ("fastdeploy.worker.worker_process",)
_ROUTED_METHODS = (
    "inspect_model_cls",
    "is_text_generation_model",
    "is_multimodal_model",
    "is_pooling_model",
    "is_reasoning_model",
)
_WRAPPED = "_fdfleet_wrapped"


def _import(name: str) -> Any | None:
    """``importlib.import_module(name)``, or ``None`` when it cannot be imported here."""
    try:
        return importlib.import_module(name)
    except Exception as e:  # any failure means "not usable in this version"
        logger.debug("fastdeploy module %s not usable: %s", name, e)
        return None


def _model_registry() -> tuple[Any, Any]:
    """FastDeploy's ``(ModelRegistry, its module)``."""
    for name in _REGISTRY_MODULES:
        module = _import(name)
        registry = getattr(module, "ModelRegistry", None)
        if registry is not None:
            return registry, module
    raise ImportError(
        f"fastdeploy is installed but no ModelRegistry was found in {', '.join(_REGISTRY_MODULES)}"
    )


def _registered_architectures(registry: Any) -> set[str]:
    names: set[str] = set()
    if callable(getattr(registry, "get_supported_archs", None)):
        names.update(registry.get_supported_archs())
    for attr in ("_arch_to_model_cls", "_enhanced_models"):
        table = getattr(registry, attr, None)
        if isinstance(table, Mapping):
            names.update(table)
    return names


def _accepted_kwargs(fn: Callable[..., Any], wanted: dict[str, Any]) -> dict[str, Any]:
    """The items of ``wanted`` that ``fn`` takes as keywords."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(wanted)
    return {k: v for k, v in wanted.items() if k in params}


def _registered_class(registry: Any, name: str) -> Any:
    """The class FastDeploy has under ``name`` (traditional table, else the lazy entry), or ``None``."""
    table = getattr(registry, "_arch_to_model_cls", None)
    if isinstance(table, Mapping) and name in table:
        return table[name]
    entry = getattr(registry, "_enhanced_models", {}).get(name)
    if isinstance(entry, Mapping):
        if entry.get("class") is not None:
            return entry["class"]
        return f"{entry.get('module_path')}.{entry.get('module_name')}.{entry.get('class_name')}"
    return None


def _describe(cls: Any) -> str:
    if isinstance(cls, str):
        return cls
    return f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', cls)}"


def _is_ours(registry: Any, name: str, cls: type) -> bool:
    entry = getattr(registry, "_enhanced_models", {}).get(name)
    table = getattr(registry, "_arch_to_model_cls", {})
    in_table = not isinstance(table, Mapping) or table.get(name) is cls
    in_entry = not isinstance(entry, Mapping) or (
        entry.get("module_path") == MODULE_PATH and entry.get("class_name") == cls.__name__
    )
    return name in _registered_architectures(registry) and in_table and in_entry


def _register_class(registry: Any, registry_module: Any, name: str, cls: type) -> None:
    wanted: dict[str, Any] = {
        "architecture": name,
        "module_name": MODULE_NAME,
        "module_path": MODULE_PATH,
        "primary_use": None,
    }
    category = getattr(getattr(registry_module, "ModelCategory", None), "TEXT_GENERATION", None)
    if category is not None:
        wanted["category"] = category
    register = registry.register_model_class
    kwargs = _accepted_kwargs(register, wanted)
    if "model_class" in inspect.signature(register).parameters or not kwargs:
        register(cls, **kwargs)
    else:  # a decorator factory: register(**metadata)(cls)
        decorator = register(**kwargs)
        if callable(decorator) and decorator is not cls:
            decorator(cls)


def _register_pretrained(registry: Any) -> list[str]:
    """What the v0 loader's ``get_pretrain_cls(ARCHITECTURE)`` returns (``serving.pretrained``)."""
    register = getattr(registry, "register_pretrained_model", None)
    table = getattr(registry, "_arch_to_pretrained_model_cls", None)
    if not callable(register):
        return []
    from .pretrained import PaddleFleetPretrainedModel

    if isinstance(table, Mapping) and table.get(ARCHITECTURE) is PaddleFleetPretrainedModel:
        return []
    register(PaddleFleetPretrainedModel)
    return [f"v0 loader entry {ARCHITECTURE} (serving.pretrained.PaddleFleetPretrainedModel)"]


def _register_architecture(registry: Any, registry_module: Any) -> list[str]:
    """Register ``PaddleFleetForCausalLM`` (+ its RL name), replacing a same-named FastDeploy class."""
    from .model import PaddleFleetForCausalLM, PaddleFleetForCausalLMRL

    done = _register_pretrained(registry)
    for name, cls in ((ARCHITECTURE, PaddleFleetForCausalLM), (RL_ARCHITECTURE, PaddleFleetForCausalLMRL)):
        if _is_ours(registry, name, cls):
            continue
        previous = _registered_class(registry, name)
        _register_class(registry, registry_module, name, cls)
        if previous is not None:
            # the one line that says which class serves (FastDeploy #7964 on ships its own); a
            # warning so it shows with FastDeploy's logging (its root logger keeps no INFO handler)
            logger.warning(
                "%s: the paddlefleet plugin's class %s serves; FastDeploy's own %s is set aside "
                "in this process (unset FD_PLUGINS=paddlefleet to use it)",
                name,
                _describe(cls),
                _describe(previous),
            )
            done.append(f"replaced {name} ({_describe(previous)} -> {_describe(cls)})")
        else:
            done.append(f"registered architecture {name} ({MODULE_PATH}.{MODULE_NAME})")
    return done


def _is_model_impl_list(value: Any) -> bool:
    return (
        isinstance(value, list | tuple)
        and all(isinstance(v, str) for v in value)
        and "auto" in value
        and ("paddleformers" in value or "fastdeploy" in value)
    )


def _extend_constants(module: Any) -> list[str]:
    """Add ``paddlefleet`` to module-level model-impl choice lists (``*MODEL_IMPL*`` names)."""
    done = []
    for attr in dir(module):
        if "MODEL_IMPL" not in attr.upper():
            continue
        value = getattr(module, attr, None)
        if not _is_model_impl_list(value) or MODEL_IMPL in value:
            continue
        if isinstance(value, list):
            value.append(MODEL_IMPL)
        else:
            setattr(module, attr, (*value, MODEL_IMPL))
        done.append(f"{module.__name__}.{attr}")
    return done


def _extend_parser_choices(parser: Any) -> bool:
    """Add ``paddlefleet`` to the choices of a built parser's ``--model-impl`` option."""
    for action in getattr(parser, "_actions", ()):
        if not {"--model-impl", "--model_impl"} & set(action.option_strings):
            continue
        if action.choices is not None and MODEL_IMPL not in action.choices:
            action.choices = [*action.choices, MODEL_IMPL]
            return True
    return False


def _wrap_engine_args(engine_args: Any) -> list[str]:
    """Wrap ``EngineArgs.add_cli_args`` and ``EngineArgs.__post_init__`` (once)."""
    done = []
    add_cli_args = inspect.getattr_static(engine_args, "add_cli_args", None)
    raw = getattr(add_cli_args, "__func__", add_cli_args)
    if callable(raw) and not getattr(raw, _WRAPPED, False):

        @functools.wraps(raw)
        def add_cli_args_wrapper(*args: Any, **kwargs: Any) -> Any:
            parser = raw(*args, **kwargs)
            built = parser if parser is not None else (args[-1] if args else None)
            _extend_parser_choices(built)
            return parser

        setattr(add_cli_args_wrapper, _WRAPPED, True)
        wrapped: Any = add_cli_args_wrapper
        if isinstance(add_cli_args, staticmethod):
            wrapped = staticmethod(add_cli_args_wrapper)
        elif isinstance(add_cli_args, classmethod):
            wrapped = classmethod(add_cli_args_wrapper)
        engine_args.add_cli_args = wrapped
        done.append("EngineArgs.add_cli_args --model-impl choices")

    post_init = getattr(engine_args, "__post_init__", None)
    if callable(post_init) and not getattr(post_init, _WRAPPED, False):

        @functools.wraps(post_init)
        def post_init_wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            if str(getattr(self, "model_impl", "")).strip().lower() == MODEL_IMPL:
                # FastDeploy's own list (local to __post_init__, and the worker CLI's) lacks it
                os.environ[MODEL_IMPL_ENV] = MODEL_IMPL
                self.model_impl = "auto"
                logger.info(
                    "model_impl=paddlefleet: FastDeploy sees 'auto', %s routes the model", MODEL_IMPL_ENV
                )
            return post_init(self, *args, **kwargs)

        setattr(post_init_wrapper, _WRAPPED, True)
        engine_args.__post_init__ = post_init_wrapper
        done.append("EngineArgs.__post_init__ model_impl check")
    return done


def _route_registry(registry: Any) -> list[str]:
    """Wrap the registry's per-config lookups so ``paddlefleet`` resolves to our class."""
    done = []
    for name in _ROUTED_METHODS:
        method = inspect.getattr_static(registry, name, None)
        if not inspect.isfunction(method) or getattr(method, _WRAPPED, False):
            continue

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def routed(
                self: Any, architectures: Any, model_config: Any = None, *args: Any, **kwargs: Any
            ) -> Any:
                if _wants_paddlefleet(model_config):
                    _lead_with_architecture(model_config)
                    architectures = [ARCHITECTURE]
                return original(self, architectures, model_config, *args, **kwargs)

            setattr(routed, _WRAPPED, True)
            return routed

        setattr(registry, name, make(method))
        done.append(name)
    return [f"ModelRegistry.{', '.join(done)} route model_impl=paddlefleet"] if done else []


def _lead_with_architecture(model_config: Any, original: Sequence[str] | None = None) -> None:
    """Put ``PaddleFleetForCausalLM`` first in ``model_config.architectures``, the other names after it.

    ``original``: names to keep after ours (default: the current list).
    """
    archs = getattr(model_config, "architectures", None)
    archs = [archs] if isinstance(archs, str) else list(archs or [])
    names = [*archs, *(original or [])]
    wanted = [ARCHITECTURE, *dict.fromkeys(a for a in names if a != ARCHITECTURE)]
    if archs == wanted:
        return
    try:
        model_config.architectures = wanted
    except (AttributeError, TypeError):  # a read-only config: the lookup result still names our class
        logger.debug("model_config.architectures is read-only; left as %s", archs)


def _wrap_model_config(model_config_cls: Any) -> list[str]:
    """Wrap ``ModelConfig._post_init`` (once) so the checkpoint's architectures stay after ours.

    FastDeploy's ``_post_init`` ends with ``architectures = [resolved name]``; with
    ``paddlefleet`` chosen the names read from ``config.json`` are put back after
    ``PaddleFleetForCausalLM`` (ERNIE's tokenizer choice and the MTP draft model read them),
    and ``num_key_value_heads`` / ``head_dim`` are raised so FastDeploy's single cache shape
    fits every layer (``cache_views.fit_fastdeploy_model_config``; engine and workers
    build their own ``ModelConfig``, both go through here).
    """
    post_init = getattr(model_config_cls, "_post_init", None)
    if not callable(post_init) or getattr(post_init, _WRAPPED, False):
        return []

    @functools.wraps(post_init)
    def post_init_wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        original = getattr(self, "architectures", None)
        original = [original] if isinstance(original, str) else list(original or [])
        out = post_init(self, *args, **kwargs)
        if _wants_paddlefleet(self):
            _lead_with_architecture(self, original)
            # FastDeploy sizes ONE cache shape for every layer from these fields: make every layer fit
            from .cache_views import fit_fastdeploy_model_config

            fit_fastdeploy_model_config(self)
        return out

    setattr(post_init_wrapper, _WRAPPED, True)
    model_config_cls._post_init = post_init_wrapper
    return ["ModelConfig._post_init keeps the original architectures after ours"]


def register_model_impl(*, early: bool = False) -> bool:
    """Make ``--model-impl paddlefleet`` / ``EngineArgs(model_impl="paddlefleet")`` accepted (idempotent).

    ``early``: called while ``import fastdeploy`` runs; modules in ``_LATE_ARGS_MODULES``
    are then only patched when already imported. ``True`` when ``EngineArgs`` was found.
    """
    actions = []
    found = False
    for name in _ARGS_MODULES:
        if early and name in _LATE_ARGS_MODULES and name not in sys.modules:
            continue
        module = _import(name)
        if module is None:
            continue
        actions += [f"model-impl choices {c} += {MODEL_IMPL}" for c in _extend_constants(module)]
        engine_args = getattr(module, "EngineArgs", None)
        if isinstance(engine_args, type):
            found = True
            actions += _wrap_engine_args(engine_args)
        model_config = getattr(module, "ModelConfig", None)
        if isinstance(model_config, type):
            actions += _wrap_model_config(model_config)
    if actions:
        logger.info("paddlefleet plugin (%s): %s", "early" if early else "model register", "; ".join(actions))
    # window recycling in FastDeploy's scheduler: patches ResourceManagerV1 once it is imported
    # (it stays inert unless --model-impl paddlefleet serves a plan with windows)
    from .kv_recycling.scheduler import install_when_imported

    install_when_imported()
    return found


def register_with_fastdeploy() -> bool:
    """Register with the installed FastDeploy (idempotent); ``True`` when the architecture is registered."""
    registry, registry_module = _model_registry()
    register_model_impl()
    actions = _register_architecture(registry, registry_module)
    actions += _route_registry(registry)
    if actions:
        logger.info("paddlefleet plugin: %s", "; ".join(actions))
    else:
        logger.info("paddlefleet plugin: already registered with FastDeploy (%s)", ARCHITECTURE)
    return ARCHITECTURE in _registered_architectures(registry)
