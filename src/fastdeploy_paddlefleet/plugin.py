"""FastDeploy plugin entry point (group ``fastdeploy.model_register_plugins``).

FastDeploy calls :func:`register` once per process when ``FD_PLUGINS``
lists ``paddlefleet``. Without FastDeploy installed it logs one line and
returns, so the package stays importable everywhere.
"""

from __future__ import annotations

import importlib.util
import logging
import os

from .envs import log_level

logger = logging.getLogger(__name__)


def _apply_log_level() -> None:
    """``FDFLEET_LOG_LEVEL``, when set, is the level of every ``fastdeploy_paddlefleet`` logger."""
    if os.environ.get("FDFLEET_LOG_LEVEL", "").strip():
        logging.getLogger(__package__).setLevel(log_level())


def register() -> bool:
    """Register the PaddleFleet model class(es) with FastDeploy.

    Returns ``True`` when something was registered, ``False`` when FastDeploy
    is not installed.
    """
    _apply_log_level()
    if importlib.util.find_spec("fastdeploy") is None:
        logger.info("fastdeploy is not installed; paddlefleet plugin registration skipped")
        return False
    from ._fastdeploy_registration import register_with_fastdeploy

    return register_with_fastdeploy()
