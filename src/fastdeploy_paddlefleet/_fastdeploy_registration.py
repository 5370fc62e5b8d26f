"""Registration with an installed FastDeploy (called by ``plugin.register()``).

Three things, each idempotent:

1. **Architecture.** ``PaddleFleetForCausalLM`` is registered with
   ``ModelRegistry.register_model_class`` under its ``name()``, with this
   package's module path (``fastdeploy_paddlefleet`` + ``model``). Only that
   name: registering PaddleFormers' fleet-backed architectures
   (``Qwen3ForCausalLM``, ...) would shadow FastDeploy's native classes for
   every user of the process. Instead ``--model-impl paddlefleet`` routes any
   architecture to this class (3.).
2. **``paddlefleet`` as a model-impl.** FastDeploy versions list the accepted
   values in several places: a module constant, the ``--model-impl``
   argparse ``choices`` of ``EngineArgs.add_cli_args``, and a list local to
   ``EngineArgs.__post_init__`` (and the worker's own CLI, which only ever
   sees what the engine passes on). Module constants are extended in place,
   ``add_cli_args`` is wrapped to extend the built parser's choices, and
   ``__post_init__`` is wrapped so ``paddlefleet`` passes: the choice is
   recorded in ``FDFLEET_MODEL_IMPL=paddlefleet`` (inherited by the worker
   processes FastDeploy spawns) and FastDeploy's own checks and worker CLI
   see ``auto``.
3. **Routing.** The registry's per-config lookups (``inspect_model_cls``,
   ``is_text_generation_model``, ...) are wrapped: when the model config's
   ``model_impl`` is ``paddlefleet`` (or ``FDFLEET_MODEL_IMPL`` says so) they
   answer for ``PaddleFleetForCausalLM`` and put it first in
   ``model_config.architectures`` (the loaders build
   ``ModelRegistry.get_class(architectures[0])``; the original names stay
   after it).

Signatures drift between FastDeploy versions: every call passes only the
keyword arguments the installed function accepts.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from .envs import MODEL_IMPL_VAR, model_impl_is_paddlefleet

logger = logging.getLogger(__name__)

ARCHITECTURE = "PaddleFleetForCausalLM"
MODEL_IMPL = "paddlefleet"
MODULE_PATH = "fastdeploy_paddlefleet"
MODULE_NAME = "model"
#: set by the plugin when ``--model-impl paddlefleet`` was chosen; read by the registry routing
MODEL_IMPL_ENV = MODEL_IMPL_VAR

_REGISTRY_MODULES = ("fastdeploy.model_executor.models.model_base", "fastdeploy.model_executor.models")
_ARGS_MODULES = ("fastdeploy.engine.args_utils", "fastdeploy.config", "fastdeploy.worker.worker_process")
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


def _register_architecture(registry: Any, registry_module: Any) -> bool:
    """Register ``PaddleFleetForCausalLM``; ``False`` when it already was."""
    if ARCHITECTURE in _registered_architectures(registry):
        return False
    from .model import PaddleFleetForCausalLM

    wanted: dict[str, Any] = {
        "architecture": ARCHITECTURE,
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
        register(PaddleFleetForCausalLM, **kwargs)
    else:  # a decorator factory: register(**metadata)(cls)
        decorator = register(**kwargs)
        if callable(decorator) and decorator is not PaddleFleetForCausalLM:
            decorator(PaddleFleetForCausalLM)
    return True


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


def _wants_paddlefleet(model_config: Any) -> bool:
    impl = model_config.get("model_impl") if isinstance(model_config, Mapping) else None
    if impl is None and model_config is not None:
        impl = getattr(model_config, "model_impl", None)
    if str(getattr(impl, "value", impl) or "").strip().lower() == MODEL_IMPL:
        return True
    return model_impl_is_paddlefleet()


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


def _lead_with_architecture(model_config: Any) -> None:
    """Put ``PaddleFleetForCausalLM`` first in ``model_config.architectures`` (originals kept after it)."""
    archs = getattr(model_config, "architectures", None)
    if isinstance(archs, str):
        archs = [archs]
    archs = list(archs or [])
    if archs[:1] == [ARCHITECTURE]:
        return
    try:
        model_config.architectures = [ARCHITECTURE, *[a for a in archs if a != ARCHITECTURE]]
    except (AttributeError, TypeError):  # a read-only config: the lookup result still names our class
        logger.debug("model_config.architectures is read-only; left as %s", archs)


def register_with_fastdeploy() -> bool:
    """Register with the installed FastDeploy (idempotent); ``True`` when the architecture is registered."""
    registry, registry_module = _model_registry()
    actions = []
    if _register_architecture(registry, registry_module):
        actions.append(f"registered architecture {ARCHITECTURE} ({MODULE_PATH}.{MODULE_NAME})")
    for name in _ARGS_MODULES:
        module = _import(name)
        if module is None:
            continue
        actions += [f"model-impl choices {c} += {MODEL_IMPL}" for c in _extend_constants(module)]
        engine_args = getattr(module, "EngineArgs", None)
        if isinstance(engine_args, type):
            actions += _wrap_engine_args(engine_args)
    actions += _route_registry(registry)
    if actions:
        logger.info("paddlefleet plugin: %s", "; ".join(actions))
    else:
        logger.info("paddlefleet plugin: already registered with FastDeploy (%s)", ARCHITECTURE)
    return ARCHITECTURE in _registered_architectures(registry)
