"""The plugin against FastDeploy's REAL code: CLI, offline args, registry, routing, loaders.

Each scenario runs in a fresh child process (``_fastdeploy_host.run_scenario``) with
the host on ``sys.path`` and ``FD_PLUGINS=paddlefleet``; FastDeploy itself loads the
plugin through its entry point groups (this project's editable install provides them).
The model directory is the ``tiny`` preset written by ``serving.modeldir`` (config
with ``dtype`` + safetensors weights), its ``architectures`` replaced by a native
FastDeploy name (``Qwen3ForCausalLM``) so routing and the kept names are visible.
"""

from __future__ import annotations

import json
import textwrap

import pytest
from _fastdeploy_host import host_or_skip, run_scenario

PLUGIN_ENV = {"FD_PLUGINS": "paddlefleet"}
NATIVE = "Qwen3ForCausalLM"


def with_names(script: str, model_dir: str) -> str:
    """``script`` (dedented) after ``MODEL = <model dir>`` and ``NATIVE = <native architecture>``."""
    return f"MODEL = {model_dir!r}\nNATIVE = {NATIVE!r}\n" + textwrap.dedent(script)


@pytest.fixture(scope="module")
def host():
    return host_or_skip()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from fastdeploy_paddlefleet.serving.modeldir import write_model_dir

    path = write_model_dir("tiny", tmp_path_factory.mktemp("fdtiny"), dtype="float32", seed=5)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = [NATIVE]
    config["seed"] = 123  # the model FastDeploy builds starts from other weights than the file's
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


BASELINE = """
import sys
import fastdeploy
from fastdeploy.engine.args_utils import EngineArgs
try:
    EngineArgs(model=MODEL, model_impl="paddlefleet")
    report(offline_accepted=True)
except NotImplementedError as e:
    report(offline_accepted=False, offline_error=str(e))
sys.argv = ["api_server", "--model", MODEL, "--model-impl", "paddlefleet"]
try:
    import fastdeploy.entrypoints.openai.api_server as api
except SystemExit as e:
    report(exit=e.code)
else:
    report(model_impl=api.args.model_impl)
"""


def test_api_server_parses_model_impl_paddlefleet(host, model_dir, plugin_run):
    """``python -m fastdeploy.entrypoints.openai.api_server --model-impl paddlefleet`` parses (at import).

    Without the plugin (a second child), the host's own answers: refused offline and on the CLI by
    this snapshot, accepted from #7964 on.
    """
    assert plugin_run["api_model_impl"] == "paddlefleet"
    assert plugin_run["api_engine_args_model_impl"] == "auto"  # EngineArgs.from_cli_args: routed
    alone = run_scenario(with_names(BASELINE, model_dir), host=host).check().data
    if "exit" in alone:  # this snapshot: the choice is missing, offline and on the CLI
        assert alone["exit"] == 2
        assert alone["offline_accepted"] is False and "paddlefleet" in alone["offline_error"]
    else:  # a FastDeploy that ships the choice itself (PR #7964 on)
        assert alone["model_impl"] == "paddlefleet"


OFFLINE = """
import os
import fastdeploy
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.model_executor.models.model_base import ModelRegistry

registry = ModelRegistry()
native_info, native_arch = registry.inspect_model_cls([NATIVE], None)  # before paddlefleet is chosen
args = EngineArgs(model=MODEL, model_impl="paddlefleet")
cfg = args.create_engine_config()
mla = EngineArgs(model=MLA_DIR, model_impl="paddlefleet").create_engine_config()

# the offline LLM(...) path up to the engine start (no engine can run on this CPU)
import fastdeploy.entrypoints.llm as llm_module

class _Stop(Exception):
    pass

seen = {}
def _capture(engine_args, *a, **k):
    seen["model_impl"] = engine_args.model_impl
    raise _Stop()

llm_module.LLMEngine.from_engine_args = staticmethod(_capture)
try:
    llm_module.LLM(model=MODEL, model_impl="paddlefleet")
except _Stop:
    pass

report(
    engine_args_model_impl=args.model_impl,
    env=os.environ.get("FDFLEET_MODEL_IMPL"),
    architectures=list(cfg.model_config.architectures),
    cls=repr(ModelRegistry.get_class("PaddleFleetForCausalLM")),
    rl_cls=repr(ModelRegistry.get_class("PaddleFleetForCausalLMRL")),
    native_arch=native_arch,
    native_cls=native_info.module_path,
    llm_model_impl=seen.get("model_impl"),
    supported=sorted(a for a in ModelRegistry.get_supported_archs() if "Fleet" in a),
    cache_fields=[cfg.model_config.num_key_value_heads, cfg.model_config.head_dim],
    mla_cache_fields=[mla.model_config.num_key_value_heads, mla.model_config.head_dim],
)

# then the api_server, which parses sys.argv while it is imported
import sys
sys.argv = ["api_server", "--model", MODEL, "--model-impl", "paddlefleet"]
try:
    import fastdeploy.entrypoints.openai.api_server as api
except SystemExit as e:
    report(api_exit=e.code)
else:
    # what the api_server does with them when it starts the engine
    served = EngineArgs.from_cli_args(api.args)
    report(api_model_impl=api.args.model_impl, api_engine_args_model_impl=served.model_impl)
"""


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory):
    from fastdeploy_paddlefleet.serving.modeldir import write_model_dir

    return str(write_model_dir("tiny-mla", tmp_path_factory.mktemp("fdtinymla"), dtype="float32"))


@pytest.fixture(scope="module")
def plugin_run(host, model_dir, mla_dir):
    """One child with the plugin: the offline scenario, then the api_server's argument parsing."""
    script = f"MLA_DIR = {mla_dir!r}\n" + with_names(OFFLINE, model_dir)
    return run_scenario(script, host=host, env=PLUGIN_ENV).check().data


def test_offline_engine_args_llm_and_real_registry(plugin_run):
    """``EngineArgs`` / ``LLM(model_impl="paddlefleet")``, ``create_engine_config``, the real registry."""
    data = plugin_run
    assert data["engine_args_model_impl"] == "auto"  # what FastDeploy's own checks and worker CLI see
    assert data["env"] == "paddlefleet"  # inherited by the workers FastDeploy spawns
    assert data["architectures"] == ["PaddleFleetForCausalLM", NATIVE]  # ours first, the original kept
    assert "fastdeploy_paddlefleet.serving.model.PaddleFleetForCausalLM" in data["cls"]
    assert "fastdeploy_paddlefleet.serving.model.PaddleFleetForCausalLMRL" in data["rl_cls"]
    assert data["native_arch"] == NATIVE and data["native_cls"] != "model"  # native class not shadowed
    assert data["llm_model_impl"] == "auto"
    assert set(data["supported"]) == {"PaddleFleetForCausalLM", "PaddleFleetForCausalLMRL"}
    assert data["cache_fields"] == [2, 16]  # tiny: every layer fits 2 kv heads x 16 channels
    # tiny-mla: 4 heads of q/k 24 (16 nope + 8 rope), v 16; FastDeploy alone would read head_dim 16
    assert data["mla_cache_fields"] == [4, 24]


COEXIST = """
import os
import logging

# FastDeploy from PR #7964 on: its own `paddlefleet` model-impl and an in-tree class with our
# class's name, registered while fastdeploy.model_executor.models imports (before plugins load).
os.environ.pop("FD_PLUGINS", None)
import fastdeploy
import fastdeploy.model_executor.models  # no plugin loads: FD_PLUGINS unset
from fastdeploy.engine import args_utils
from fastdeploy.model_executor.models.model_base import ModelCategory, ModelForCasualLM, ModelRegistry

@ModelRegistry.register_model_class(
    architecture="PaddleFleetForCausalLM", module_name="paddleformers", category=ModelCategory.TEXT_GENERATION
)
class PaddleFleetForCausalLM(ModelForCasualLM):  # the in-tree stand-in
    @classmethod
    def name(cls):
        return "PaddleFleetForCausalLM"

native_cli = args_utils.EngineArgs.add_cli_args
def add_cli_args_with_choice(parser):  # FastDeploy's own --model-impl paddlefleet
    parser = native_cli(parser)
    for action in parser._actions:
        if "--model-impl" in action.option_strings:
            action.choices = [*action.choices, "paddlefleet"]
    return parser
args_utils.EngineArgs.add_cli_args = staticmethod(add_cli_args_with_choice)

# now the plugin is selected; FastDeploy's own loaders load it, in FastDeploy's order
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append((record.levelname, record.getMessage()))
logging.getLogger("fastdeploy_paddlefleet").addHandler(Keep())
os.environ["FD_PLUGINS"] = "paddlefleet"
from fastdeploy.plugins import model_register, tool_parser
tool_parser.plugins_loaded = False
tool_parser.load_tool_parser_plugins()
model_register.plugins_loaded = False
model_register.load_model_register_plugins()

from fastdeploy.utils import FlexibleArgumentParser
parser = args_utils.EngineArgs.add_cli_args(FlexibleArgumentParser())
(action,) = [a for a in parser._actions if "--model-impl" in a.option_strings]
cfg = args_utils.EngineArgs(model=MODEL, model_impl="paddlefleet").create_engine_config()
served = ModelRegistry.get_class(cfg.model_config.architectures[0])
report(
    choices=list(action.choices),
    served=served.__module__ + "." + served.__name__,
    architectures=list(cfg.model_config.architectures),
    lines=[m for level, m in records if "set aside" in m],
    levels=sorted({level for level, m in records if "set aside" in m}),
)
"""


def test_plugin_class_serves_over_a_native_class_of_the_same_name(host, model_dir):
    """Routing with a pre-registered native ``PaddleFleetForCausalLM`` (FastDeploy #7964 on, simulated)."""
    data = run_scenario(with_names(COEXIST, model_dir), host=host).check().data
    assert data["choices"].count("paddlefleet") == 1
    assert data["served"] == "fastdeploy_paddlefleet.serving.model.PaddleFleetForCausalLM"
    assert data["architectures"] == ["PaddleFleetForCausalLM", NATIVE]
    assert len(data["lines"]) == 1 and data["levels"] == ["WARNING"]
    assert "__main__.PaddleFleetForCausalLM" in data["lines"][0]  # names the class set aside


WORKER = """
import copy
import sys
# what FastDeploy's engine launches: `python -m fastdeploy.worker.worker_process ... --model-impl auto`,
# with the engine's environment (FD_PLUGINS, and FDFLEET_MODEL_IMPL set by the plugin's EngineArgs)
sys.argv = [
    "worker_process", "--model", MODEL, "--model-impl", "auto", "--dtype", "float32", "--block_size", "4",
    "--load_choices", "default_v1", "--max_model_len", "256", "--max_num_batched_tokens", "256",
]
import numpy as np
from safetensors.numpy import load_file
import fastdeploy.worker.worker_process as worker_process
from fastdeploy.model_executor.model_loader import get_model_loader

cfg = worker_process.initialize_fd_config(worker_process.parse_args(), ranks=1, local_rank=0)
ref = load_file(MODEL + "/model.safetensors")
out = {"architectures": list(cfg.model_config.architectures)}


def load(c):
    loader = get_model_loader(c.load_config)
    model = loader.load_model(c)
    own = model.model.state_dict()
    diff = max(float(np.abs(own[k].numpy() - v).max()) for k, v in ref.items())
    return type(loader).__name__, type(model).__module__ + "." + type(model).__name__, diff


# the loader the worker picked itself (on this CPU host: its fallback from v1 to v0)
out["worker"] = [str(cfg.load_config.load_choices), *load(cfg)]


def attempt(name, mutate):
    c = copy.copy(cfg)
    c.load_config = copy.copy(cfg.load_config)
    c.model_config = copy.copy(cfg.model_config)
    mutate(c)
    try:
        out[name] = list(load(c))
    except Exception as e:
        out[name] = type(e).__name__ + ": " + str(e)


attempt("v1", lambda c: setattr(c.load_config, "load_choices", "default_v1"))
attempt("v0", lambda c: setattr(c.load_config, "load_choices", "default"))
attempt("rl", lambda c: setattr(c.load_config, "dynamic_load_weight", True))
attempt("cli_quant", lambda c: setattr(c.model_config, "quantization", {"quantization": "wint8"}))
attempt("ckpt_quant", lambda c: setattr(c.model_config, "quantization_config", {"quant_method": "fp8"}))
report(**out)
"""

OURS = "fastdeploy_paddlefleet.serving.model.PaddleFleetForCausalLM"


@pytest.fixture(scope="module")
def worker_run(host, model_dir):
    """One child as FastDeploy's worker: its command line, ``initialize_fd_config``, then each loader."""
    env = {**PLUGIN_ENV, "FDFLEET_MODEL_IMPL": "paddlefleet"}
    return run_scenario(with_names(WORKER, model_dir), host=host, env=env).check().data


def test_worker_process_builds_our_class_from_the_engine_command_line(worker_run):
    """The worker's own CLI + ``initialize_fd_config`` + the loader it picks (v1, or its v0 fallback)."""
    data = worker_run
    assert data["architectures"] == ["PaddleFleetForCausalLM", NATIVE]
    choice, loader, cls, diff = data["worker"]
    # on this CPU host FastDeploy's worker falls back from v1 to the v0 loader (v1_loader_support)
    assert (choice, loader) in {("default_v1", "DefaultModelLoaderV1"), ("default", "DefaultModelLoader")}
    assert cls == OURS and diff == 0.0  # the file's weights, not those of config.json's seed 123


def test_real_loaders_build_our_class_or_refuse_naming_the_loader(worker_run):
    """FastDeploy's v1 and v0 loaders build + load our class; RL / quantization are refused by name."""
    data = worker_run
    assert data["v1"] == ["DefaultModelLoaderV1", OURS, 0.0], data["v1"]
    # v0 (also FastDeploy's worker fallback from v1): get_pretrain_cls answers, full weights loaded
    assert data["v0"] == ["DefaultModelLoader", OURS, 0.0], data["v0"]
    # the RL loader imports fastdeploy.rl, then builds PaddleFleetForCausalLMRL: refused by name
    assert data["rl"].startswith("ValueError") and "RL loader" in data["rl"], data["rl"]
    assert "dynamic_load_weight" in data["rl"]
    assert data["cli_quant"].startswith("ValueError") and "--quantization" in data["cli_quant"]
    assert data["ckpt_quant"].startswith("ValueError") and "quantization_config" in data["ckpt_quant"]
    assert "fp8" in data["ckpt_quant"]
