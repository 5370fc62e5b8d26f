"""``plugin.register()`` against a FAKE ``fastdeploy`` package written into a temp dir.

The fake mirrors the shapes read from FastDeploy 2.x: ``ModelRegistry`` with a
``register_model_class`` decorator factory and per-config lookups, an
``EngineArgs`` whose ``--model-impl`` choices (argparse list, a local list in
``__post_init__`` and a module constant) lack ``paddlefleet``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import textwrap
from pathlib import Path

import pytest

MODEL_BASE = """
import enum


class ModelCategory(enum.IntFlag):
    TEXT_GENERATION = 1
    MULTIMODAL = 2


class ModelRegistry:
    _arch_to_model_cls = {}
    _enhanced_models = {}
    register_calls = 0

    def __init__(self):
        self.models = dict(self._enhanced_models)

    @classmethod
    def register_model_class(cls, model_class=None, *, architecture=None, module_name=None,
                             module_path="fastdeploy.model_executor.models",
                             category=ModelCategory.TEXT_GENERATION, primary_use=None):
        cls.register_calls += 1

        def _register(model_cls):
            cls._arch_to_model_cls[model_cls.name()] = model_cls
            if architecture and module_name:
                cls._enhanced_models[architecture] = {
                    "class_name": model_cls.__name__, "module_name": module_name,
                    "module_path": module_path, "category": primary_use or category,
                }
            return model_cls

        return _register(model_class) if model_class is not None else _register

    @classmethod
    def get_supported_archs(cls):
        return list(cls._arch_to_model_cls) + list(cls._enhanced_models)

    @classmethod
    def get_class(cls, name):
        if name not in cls._arch_to_model_cls:
            raise ValueError(f"Model {name!r} is not registered!")
        return cls._arch_to_model_cls[name]

    def inspect_model_cls(self, architectures, model_config=None):
        for arch in architectures:
            if arch in self.models or arch in self._arch_to_model_cls or arch == "Qwen3ForCausalLM":
                return ({"architecture": arch}, arch)
        raise ValueError(f"Model architectures {architectures} are not supported")

    def is_text_generation_model(self, architectures, model_config=None):
        return any(a in self.models or a == "Qwen3ForCausalLM" for a in architectures)
"""

ARGS_UTILS = """
from dataclasses import dataclass

MODEL_IMPL_CHOICES = ["auto", "fastdeploy", "paddleformers"]


@dataclass
class EngineArgs:
    model: str = "m"
    model_impl: str = "auto"

    def __post_init__(self):
        valid_model_impls = ["auto", "fastdeploy", "paddleformers"]
        if self.model_impl not in valid_model_impls:
            raise NotImplementedError(f"not support model_impl: {self.model_impl!r}")

    @staticmethod
    def add_cli_args(parser):
        group = parser.add_argument_group("Model Configuration")
        group.add_argument("--model", type=str, default="m")
        group.add_argument("--model-impl", type=str, choices=["auto", "fastdeploy", "paddleformers"],
                           default="auto")
        return parser
"""


def _write_fake_fastdeploy(root: Path, model_base: str = MODEL_BASE) -> None:
    files = {
        "fastdeploy/__init__.py": "",
        "fastdeploy/model_executor/__init__.py": "",
        "fastdeploy/model_executor/models/__init__.py": "",
        "fastdeploy/model_executor/models/model_base.py": model_base,
        "fastdeploy/engine/__init__.py": "",
        "fastdeploy/engine/args_utils.py": ARGS_UTILS,
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def _drop_fake_modules() -> None:
    for name in [m for m in sys.modules if m == "fastdeploy" or m.startswith("fastdeploy.")]:
        del sys.modules[name]


@pytest.fixture
def fake_fastdeploy(tmp_path, monkeypatch):
    _write_fake_fastdeploy(tmp_path)
    _drop_fake_modules()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("FDFLEET_MODEL_IMPL", "")  # recorded, so the value the plugin sets is undone
    monkeypatch.delenv("FDFLEET_MODEL_IMPL")
    importlib.invalidate_caches()
    yield tmp_path
    _drop_fake_modules()


def _register() -> bool:
    from fastdeploy_paddlefleet.serving import entry_points as plugin

    return plugin.register()


def test_register_adds_architecture_with_our_module_path(fake_fastdeploy, caplog):
    from fastdeploy_paddlefleet.serving.model import PaddleFleetForCausalLM

    with caplog.at_level(logging.INFO, logger="fastdeploy_paddlefleet"):
        assert _register() is True
    from fastdeploy.model_executor.models.model_base import ModelCategory, ModelRegistry

    entry = ModelRegistry._enhanced_models["PaddleFleetForCausalLM"]
    assert entry["module_path"] == "fastdeploy_paddlefleet.serving"
    assert entry["module_name"] == "model"
    assert entry["category"] == ModelCategory.TEXT_GENERATION
    # what FastDeploy's lazy loader does with the entry
    module = importlib.import_module(f"{entry['module_path']}.{entry['module_name']}")
    assert getattr(module, entry["class_name"]) is PaddleFleetForCausalLM
    assert ModelRegistry.get_class("PaddleFleetForCausalLM") is PaddleFleetForCausalLM
    # FastDeploy's own architectures are not shadowed; the RL name refuses by itself
    assert set(ModelRegistry.get_supported_archs()) == {"PaddleFleetForCausalLM", "PaddleFleetForCausalLMRL"}
    text = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
    assert "registered architecture PaddleFleetForCausalLM" in text
    assert "model-impl" in text


def test_register_extends_model_impl_choices(fake_fastdeploy):
    assert _register() is True
    from fastdeploy.engine import args_utils

    assert args_utils.MODEL_IMPL_CHOICES == ["auto", "fastdeploy", "paddleformers", "paddlefleet"]
    parser = args_utils.EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert parser.parse_args(["--model-impl", "paddlefleet"]).model_impl == "paddlefleet"
    assert parser.parse_args(["--model-impl", "paddleformers"]).model_impl == "paddleformers"
    with pytest.raises(SystemExit):  # still a closed list
        parser.parse_args(["--model-impl", "bogus"])


def test_paddlefleet_engine_args_route_to_our_class(fake_fastdeploy, monkeypatch):
    import os
    from types import SimpleNamespace

    assert _register() is True
    from fastdeploy.engine.args_utils import EngineArgs
    from fastdeploy.model_executor.models.model_base import ModelRegistry

    native_cfg = SimpleNamespace(model_impl="auto", architectures=["Qwen3ForCausalLM"])
    assert ModelRegistry().inspect_model_cls(["Qwen3ForCausalLM"], native_cfg)[1] == "Qwen3ForCausalLM"
    assert native_cfg.architectures == ["Qwen3ForCausalLM"]
    with pytest.raises(NotImplementedError):  # FastDeploy's own check is still there for other values
        EngineArgs(model_impl="bogus")

    args = EngineArgs(model_impl="paddlefleet")  # FastDeploy's local list lacks it: must not raise
    assert args.model_impl == "auto"  # what FastDeploy and its worker CLI see
    assert os.environ["FDFLEET_MODEL_IMPL"] == "paddlefleet"
    worker_cfg = SimpleNamespace(model_impl="auto", architectures=["Qwen3ForCausalLM"])
    registry = ModelRegistry()
    assert registry.is_text_generation_model(worker_cfg.architectures, worker_cfg) is True
    assert registry.inspect_model_cls(["Qwen3ForCausalLM"], worker_cfg)[1] == "PaddleFleetForCausalLM"
    assert worker_cfg.architectures == ["PaddleFleetForCausalLM", "Qwen3ForCausalLM"]

    monkeypatch.delenv("FDFLEET_MODEL_IMPL")
    explicit = SimpleNamespace(model_impl="paddlefleet", architectures=["GptOssForCausalLM"])
    assert registry.inspect_model_cls(["GptOssForCausalLM"], explicit)[1] == "PaddleFleetForCausalLM"


def test_register_early_extends_the_cli_without_importing_the_model_package(fake_fastdeploy):
    """The hook FastDeploy runs during ``import fastdeploy`` touches the argument modules only."""
    from fastdeploy_paddlefleet.serving import entry_points as plugin

    assert plugin.register_early() is True
    assert "fastdeploy.model_executor.models.model_base" not in sys.modules
    from fastdeploy.engine import args_utils

    parser = args_utils.EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert parser.parse_args(["--model-impl", "paddlefleet"]).model_impl == "paddlefleet"
    assert args_utils.EngineArgs(model_impl="paddlefleet").model_impl == "auto"
    assert plugin.register() is True  # the model register hook afterwards: no double wrapping
    assert args_utils.MODEL_IMPL_CHOICES.count("paddlefleet") == 1


def test_register_is_idempotent(fake_fastdeploy, caplog):
    assert _register() is True
    from fastdeploy.engine import args_utils
    from fastdeploy.model_executor.models.model_base import ModelRegistry

    post_init = args_utils.EngineArgs.__post_init__
    inspect_fn = ModelRegistry.inspect_model_cls
    with caplog.at_level(logging.INFO, logger="fastdeploy_paddlefleet"):
        assert _register() is True
        assert _register() is True
    assert ModelRegistry.register_calls == 2  # the class and its RL name, once each
    assert args_utils.MODEL_IMPL_CHOICES.count("paddlefleet") == 1
    assert args_utils.EngineArgs.__post_init__ is post_init
    assert ModelRegistry.inspect_model_cls is inspect_fn
    parser = args_utils.EngineArgs.add_cli_args(argparse.ArgumentParser())
    (action,) = [a for a in parser._actions if "--model-impl" in a.option_strings]
    assert list(action.choices).count("paddlefleet") == 1
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert (
        messages.count("paddlefleet plugin: already registered with FastDeploy (PaddleFleetForCausalLM)") == 2
    )


def test_register_passes_only_accepted_keywords(tmp_path, monkeypatch):
    """An older registry whose register_model_class takes no category / primary_use."""
    old = MODEL_BASE.replace(
        'module_path="fastdeploy.model_executor.models",\n'
        "                             category=ModelCategory.TEXT_GENERATION, primary_use=None):",
        'module_path="fastdeploy.model_executor.models"):\n        category = primary_use = None',
    )
    assert old != MODEL_BASE
    _write_fake_fastdeploy(tmp_path, old)
    _drop_fake_modules()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("FDFLEET_MODEL_IMPL", "")
    importlib.invalidate_caches()
    try:
        assert _register() is True
        from fastdeploy.model_executor.models.model_base import ModelRegistry

        entry = ModelRegistry._enhanced_models["PaddleFleetForCausalLM"]
        assert (entry["module_path"], entry["module_name"]) == ("fastdeploy_paddlefleet.serving", "model")
    finally:
        _drop_fake_modules()


def test_register_without_fastdeploy_is_a_logged_no_op(monkeypatch, caplog):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "fastdeploy" else real_find_spec(name, *a),
    )
    with caplog.at_level(logging.INFO, logger="fastdeploy_paddlefleet"):
        assert _register() is False
    assert any("fastdeploy is not installed" in r.getMessage() for r in caplog.records)


# -- load-time refusals and FastDeploy's parallel config (no FastDeploy needed) ------------------
def _fd_config(**over):
    from types import SimpleNamespace

    cfg = SimpleNamespace(
        model_config=SimpleNamespace(quantization=None, quantization_config=None),
        load_config=SimpleNamespace(load_choices="default_v1", dynamic_load_weight=False),
        quant_config=None,
    )
    for path, value in over.items():
        owner, name = path.split("__")
        setattr(getattr(cfg, owner), name, value) if owner != "fd" else setattr(cfg, name, value)
    return cfg


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ({"load_config__dynamic_load_weight": True}, ["RL loader", "dynamic_load_weight"]),
        ({"model_config__quantization": {"quantization": "wint8"}}, ["--quantization", "wint8"]),
        ({"model_config__quantization_config": {"quant_method": "fp8"}}, ["quantization_config", "fp8"]),
    ],
)
def test_load_time_refusals_name_the_setting(setting, words):
    from fastdeploy_paddlefleet.serving.checks import check_fd_config

    with pytest.raises(ValueError) as err:
        check_fd_config(_fd_config(**setting), "PaddleFleetForCausalLM")
    for word in words:
        assert word in str(err.value)


def test_load_time_checks_pass_the_v1_v0_and_dummy_loaders():
    from fastdeploy_paddlefleet.serving.checks import check_fd_config

    check_fd_config(_fd_config(), "PaddleFleetForCausalLM")
    check_fd_config(_fd_config(load_config__load_choices="dummy"), "PaddleFleetForCausalLM")
    check_fd_config(_fd_config(load_config__load_choices="default"), "PaddleFleetForCausalLM")


def test_rl_class_refuses_naming_the_rl_loader():
    from fastdeploy_paddlefleet.serving.model import PaddleFleetForCausalLMRL

    assert PaddleFleetForCausalLMRL.name() == "PaddleFleetForCausalLMRL"
    with pytest.raises(ValueError, match="RL loader"):
        PaddleFleetForCausalLMRL(_fd_config(load_config__dynamic_load_weight=True))


def test_parallel_setup_checks_fastdeploy_groups():
    from types import SimpleNamespace

    from fastdeploy_paddlefleet.serving.parallel import parallel_setup

    def cfg(**pc):
        return SimpleNamespace(parallel_config=SimpleNamespace(**pc))

    assert parallel_setup(cfg()).tp_size == 1
    with pytest.raises(ValueError, match="tp_group is None"):
        parallel_setup(cfg(tensor_parallel_size=2, tensor_parallel_rank=0))
    with pytest.raises(ValueError, match="tp_group has 4 ranks"):
        parallel_setup(
            cfg(tensor_parallel_size=2, tensor_parallel_rank=1, tp_group=SimpleNamespace(nranks=4))
        )
    with pytest.raises(ValueError, match="tensor_parallel_rank=2"):
        parallel_setup(
            cfg(tensor_parallel_size=2, tensor_parallel_rank=2, tp_group=SimpleNamespace(nranks=2))
        )
    setup = parallel_setup(
        cfg(tensor_parallel_size=2, tensor_parallel_rank=1, tp_group=SimpleNamespace(nranks=2))
    )
    assert (setup.tp_size, setup.tp_rank, setup.tensor_parallel) == (2, 1, True)


def test_cut_concatenates_the_rank_slices():
    import numpy as np

    from fastdeploy_paddlefleet.serving.parallel import cut

    full = np.arange(24, dtype="float32").reshape(2, 12)
    got = cut(full, 1, [(0, 2), (6, 8)]).numpy()
    assert np.array_equal(got, np.concatenate([full[:, 0:2], full[:, 6:8]], axis=1))


def test_model_dir_writer(tmp_path):
    import json

    from safetensors.numpy import load_file

    from fastdeploy_paddlefleet.serving.modeldir import main, write_model_dir

    out = write_model_dir("tiny", tmp_path / "tiny", dtype="float32", seed=3)
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32" and "torch_dtype" not in config and "_comment" not in config
    assert len(load_file(str(out / "model.safetensors"))) > 0
    with pytest.raises(ValueError, match="only minifleet presets"):
        write_model_dir("gpt-oss-20b", tmp_path / "x")
    assert main(["gpt-oss-20b", str(tmp_path / "y")]) == 2
