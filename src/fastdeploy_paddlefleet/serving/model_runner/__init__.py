"""The model-runner plugin: FastDeploy's ``GPUModelRunner`` with per-layer KV caches and page tables.

FastDeploy's ``fastdeploy.model_runner_plugins`` entry point group (``plugins/model_runner``) is
read when ``fastdeploy.worker.gpu_worker`` (and ``xpu_worker``) is imported: with ``FD_PLUGINS``
listing ``paddlefleet``, :func:`model_runner_plugin` is called and the CLASS it returns replaces
``GPUModelRunner`` for every model that worker serves. FastDeploy asserts that exactly ONE plugin of
that group is selected; with two (``FD_PLUGINS=paddlefleet,other`` where ``other`` also has a model
runner) the assertion fails inside FastDeploy's ``try`` and the worker logs it at INFO and falls
back to its own ``GPUModelRunner`` (no per-layer caches, no window recycling). The runner behaves
exactly like FastDeploy's for models that are not the plugin's (``runner.py``).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def model_runner_plugin() -> type:
    """Entry point (group ``fastdeploy.model_runner_plugins``): the runner class.

    ``RuntimeError`` on an XPU worker (its loader takes the plugin's class in place of
    ``XPUModelRunner``; FastDeploy catches the error and keeps its own runner).
    """
    from fastdeploy.platforms import current_platform

    if current_platform.is_xpu():
        raise RuntimeError("the paddlefleet model runner extends GPUModelRunner; XPU keeps its own runner")
    from .runner import runner_class

    return runner_class()


__all__ = ["model_runner_plugin"]
