"""Several hosts through vLLM's Ray backend, on one GPU machine: a head node started from
the launching shell without GPUs, and a second node, started from a clean environment
(no KT_* variables), that holds the GPU. `vllm serve --distributed-executor-backend ray
--quantization kt-hybrid` must run its worker on the second node with the launching
shell's KT_* settings, and answer like plain vLLM.

Skipped without a GPU or without Ray (vLLM's CPU build cannot use Ray); run on a GPU box
with ``python -m pytest -m gpu tests/engine/test_ray_gpu.py``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kt_testing.engines import clean_env
from kt_testing.openai_client import SERVE_ARGS, ask

from vllm_kt_tools.support.server import VLLMServer, free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.engine,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(shutil.which("ray") is None, reason="needs Ray's `ray` command"),
]

KT = {"KT_NUM_GPU_EXPERTS": "2", "KT_METHOD": "BF16", "KT_EXPERT_PLACEMENT": "uniform"}
# What a node started by hand on another host would have: no KT_*, no VLLM_*.
BARE_NAMES = ("PATH", "HOME", "PYTHONPATH", "LD_LIBRARY_PATH", "TMPDIR")
# Ray prefixes the lines its workers print with "(ActorClass pid=N[, ip=A.B.C.D])", colored.
RAY_WORKER_LINE = re.compile(r"^(?:\x1b\[\d+m)?\(RayWorker\w* pid=\d+(?:, ip=[^)]+)?\)")


def ray(*args: str, env: dict[str, str]) -> None:
    proc = subprocess.run(["ray", *args], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"ray {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"


@contextlib.contextmanager
def two_ray_nodes() -> Iterator[str]:
    """A head without GPUs from this shell, a GPU node from a clean environment; yields
    the head's address."""
    port = free_port()
    shell = clean_env()
    bare = {name: os.environ[name] for name in BARE_NAMES if name in os.environ}
    common = ["--disable-usage-stats", "--num-cpus=4"]
    ray("start", "--head", f"--port={port}", "--num-gpus=0", "--include-dashboard=false", *common, env=shell)
    try:
        ray("start", f"--address=127.0.0.1:{port}", "--num-gpus=1", *common, env=bare)
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run(["ray", "stop", "--force"], env=shell, capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def qwen3(tiny_model) -> Path:
    return tiny_model("qwen3_moe")


@pytest.fixture(scope="module")
def plain_answers(qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    log = tmp_path_factory.mktemp("plain") / "serve.log"
    with VLLMServer(qwen3, SERVE_ARGS, env=clean_env(VLLM_PLUGINS=""), log_path=log) as server:
        return ask(server)


def test_kt_settings_reach_a_ray_worker_on_another_node(qwen3: Path, tmp_path: Path, plain_answers: dict) -> None:
    """Under vLLM 0.32's default Ray executor (RayExecutorV2). Its older one
    (VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0) refuses a launching node without GPUs ("Current
    node has no GPU available"), so it cannot run this layout on one GPU; that it copies
    KT_* is tested in tests/unit/test_parallel.py."""
    log = tmp_path / "serve.log"
    args = [*SERVE_ARGS, "--quantization", "kt-hybrid", "--distributed-executor-backend", "ray"]
    with two_ray_nodes() as address:
        env = clean_env(**KT, RAY_ADDRESS=address, VLLM_USE_RAY_V2_EXECUTOR_BACKEND="1")
        with VLLMServer(qwen3, args, env=env, log_path=log) as server:
            answers = ask(server)
    text = log.read_text(errors="replace")
    worker_lines = [line for line in text.splitlines() if RAY_WORKER_LINE.match(line)]
    # The layers were built in a Ray worker, with the placement the launching shell asked for,
    assert any("kt-hybrid: KT_NUM_GPU_EXPERTS=2; placement uniform" in line for line in worker_lines), text[-6000:]
    assert any("each MoE layer keeps 2 GPU experts" in line for line in worker_lines), text[-6000:]
    # from a worker environment that holds the launching shell's KT_* (else it names them),
    assert "this worker's KT_* environment differs" not in text
    # and the answers are plain vLLM's.
    assert answers == plain_answers
