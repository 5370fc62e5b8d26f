"""Two-or-more CPU processes on paddle's gloo backend, for the multi-rank tests.

Launchers (test files) pick loopback endpoints and run one worker script per rank; workers call
:func:`set_gloo_env` before importing paddle.distributed. One place for the environment contract
documented in HOST_INTERFACES.md ("Collectives between two CPU processes").
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path


def free_endpoints(n: int) -> list[str]:
    """``n`` loopback ``host:port`` endpoints whose ports were free a moment ago."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [f"127.0.0.1:{s.getsockname()[1]}" for s in socks]
    finally:
        for s in socks:
            s.close()


def set_gloo_env(rank: int, endpoints: list[str]) -> None:
    """The variables ``paddle.distributed.init_parallel_env`` reads for rank ``rank`` on gloo."""
    os.environ.update(
        PADDLE_DISTRI_BACKEND="gloo",
        PADDLE_TRAINER_ID=str(rank),
        PADDLE_TRAINERS_NUM=str(len(endpoints)),
        PADDLE_TRAINER_ENDPOINTS=",".join(endpoints),
        PADDLE_CURRENT_ENDPOINT=endpoints[rank],
    )


def run_to_completion(worker: Path, specs: list[dict], logs: list[Path], env: dict, timeout: float) -> None:
    """Run ``worker`` once per spec (``python worker '<json spec>'``, output to its log), wait for all,
    kill what is left after ``timeout`` s; fails with every log's tail unless all exit 0."""
    procs = []
    for spec, log_path in zip(specs, logs, strict=True):
        with open(log_path, "w") as log:  # the child keeps its own handle
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(worker), json.dumps(spec)], stdout=log, stderr=log, env=env
                )
            )
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    text = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs)
    assert [p.returncode for p in procs] == [0] * len(procs), text
