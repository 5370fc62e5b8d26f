"""The core (plan, envs, cache layout, ``fdfleet plan``) imports nothing heavy."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("paddle", "torch", "triton", "numpy", "paddleformers")


def test_core_imports_are_light():
    code = (
        "import sys, json\n"
        "import fastdeploy_paddlefleet.spec, fastdeploy_paddlefleet.envs\n"
        "import fastdeploy_paddlefleet.kvcache.layout, fastdeploy_paddlefleet.cli.plan\n"
        "from fastdeploy_paddlefleet.cli import main\n"
        "main(['plan', 'tiny', '--json'])\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == []
