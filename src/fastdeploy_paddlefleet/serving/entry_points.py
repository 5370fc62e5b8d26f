"""FastDeploy plugin entry points (all named ``paddlefleet``: ``FD_PLUGINS=paddlefleet`` selects them).

* :func:`register_early`, groups ``fastdeploy.tool_parser_plugins`` and
  ``fastdeploy.reasoning_parser_plugins``: FastDeploy loads those while
  ``import fastdeploy`` runs, before the api_server builds its argument parser
  (at import) and before ``EngineArgs`` is used; this makes ``--model-impl
  paddlefleet`` accepted.
* :func:`register`, group ``fastdeploy.model_register_plugins``: loaded when
  ``fastdeploy.model_executor.models`` is imported (engine and workers), after
  FastDeploy's own models; registers and routes ``PaddleFleetForCausalLM``.

Both are idempotent. Without FastDeploy installed they log one line and
return ``False``, so the package stays importable everywhere.
``docs/fastdeploy.md`` describes the mechanism and its limits.
"""

from __future__ import annotations

import importlib.util
import logging
import os

from ..envs import log_level

logger = logging.getLogger(__name__)


def _apply_log_level() -> None:
    """``FDFLEET_LOG_LEVEL``, when set, is the level of every ``fastdeploy_paddlefleet`` logger."""
    if os.environ.get("FDFLEET_LOG_LEVEL", "").strip():
        logging.getLogger(__name__.partition(".")[0]).setLevel(log_level())


def register_early() -> bool:
    """Make ``--model-impl paddlefleet`` parseable (called at ``import fastdeploy``).

    Returns ``True`` when FastDeploy's ``EngineArgs`` was found and extended.
    """
    _apply_log_level()
    if importlib.util.find_spec("fastdeploy") is None:
        logger.info("fastdeploy is not installed; paddlefleet plugin (early hook) skipped")
        return False
    from .registration import register_model_impl

    return register_model_impl(early=True)


def register() -> bool:
    """Register the PaddleFleet model class(es) with FastDeploy.

    Returns ``True`` when something was registered, ``False`` when FastDeploy
    is not installed.
    """
    _apply_log_level()
    if importlib.util.find_spec("fastdeploy") is None:
        logger.info("fastdeploy is not installed; paddlefleet plugin registration skipped")
        return False
    from .registration import register_with_fastdeploy

    return register_with_fastdeploy()
