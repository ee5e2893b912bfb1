"""`vllm serve --quantization kt-hybrid` (the real CLI and OpenAI server) answers the
completions and chat endpoints through the openai client with plain vLLM's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
from kt_testing.engines import FAST_COMPILE_CACHE, clean_env
from kt_testing.openai_client import SERVE_ARGS, ask

from vllm_kt_tools.cli.demo import serve_command_line
from vllm_kt_tools.support.server import VLLMServer, activated_env, free_port

pytestmark = pytest.mark.engine


def serve(model: Path, log: Path, kt: dict[str, str] | None) -> dict:
    """The user's command, at vLLM's default compilation (its AOT compile cache included)."""
    args = [*SERVE_ARGS, "--quantization", "kt-hybrid"] if kt is not None else SERVE_ARGS
    env = clean_env(**(kt or {"VLLM_PLUGINS": ""}))
    for name in FAST_COMPILE_CACHE:
        env.pop(name)
    with VLLMServer(model, args, env=env, log_path=log) as server:
        return ask(server)


def test_openai_server_answers_like_plain_vllm(tiny_model, tmp_path: Path) -> None:
    """The kt-hybrid server is the `vllm serve` line the demo prints, run as pasted into a
    shell with the venv active and nothing else set: on vLLM's CPU build it must carry
    VLLM_CPU_KVCACHE_SPACE itself (a copied line once failed without it)."""
    model = tiny_model("qwen3_moe")
    port = free_port()
    line = serve_command_line(model, 4, port)
    env = activated_env(clean_env())
    for name in ("VLLM_CPU_KVCACHE_SPACE", *FAST_COMPILE_CACHE):
        env.pop(name, None)
    with VLLMServer.from_command_line(line, port, env, tmp_path / "kt.log") as server:
        hybrid = ask(server)
    assert "kt-hybrid" in (tmp_path / "kt.log").read_text()
    plain = serve(model, tmp_path / "plain.log", None)
    assert len(hybrid["completion_ids"]) == 20
    assert hybrid == plain
    assert hybrid["chat_text"].startswith("Paris is the capital of France.")


def test_metrics_log_line_and_prometheus(tiny_model, tmp_path: Path) -> None:
    """KT_METRICS_INTERVAL: the engine logs per-layer CPU/GPU/wait times, and with vLLM's
    multiprocess metrics (two API servers) the counters appear on /metrics."""
    import time
    import urllib.request

    from openai import OpenAI

    from vllm_kt_plugin.hybrid.metrics import CPU_PATH, LARGE_FORWARD_TOKENS
    from vllm_kt_tools.bench.report import large_forwards

    long_tokens = LARGE_FORWARD_TOKENS + 44

    model = tiny_model("qwen3_moe")
    log = tmp_path / "serve.log"
    env = clean_env(KT_NUM_GPU_EXPERTS="4", KT_METHOD="BF16", KT_METRICS_INTERVAL="1")
    # --max-model-len again (argparse keeps the last): room for a prefill-sized prompt
    args = [*SERVE_ARGS, "--max-model-len", "512", "--quantization", "kt-hybrid", "--api-server-count", "2"]
    with VLLMServer(model, args, env, log) as server:
        ask(server)
        time.sleep(1.5)
        ask(server)  # a forward after the interval triggers the report
        long_prompt = list(range(100, 100 + long_tokens))  # a prefill-sized forward, logged with its path
        OpenAI(base_url=f"{server.base_url}/v1", api_key="EMPTY").completions.create(
            model="tiny-moe", prompt=long_prompt, max_tokens=1, temperature=0.0
        )
        body = urllib.request.urlopen(f"{server.base_url}/metrics", timeout=30).read().decode()
    text = log.read_text()
    steps = large_forwards(text)  # vLLM's profiling forward at start-up, ..., the long prompt
    assert steps and steps[-1][:2] == [long_tokens, CPU_PATH], text[-3000:]
    lines = [line for line in text.splitlines() if "kt-hybrid metrics:" in line]
    assert lines, log.read_text()[-3000:]
    assert "3 layers" in lines[-1] and "CPU experts" in lines[-1] and "-bound" in lines[-1]
    samples = [line for line in body.splitlines() if line.startswith("kt_hybrid_cpu_expert_seconds_total{")]
    assert len(samples) == 3, body[-3000:]  # one per MoE layer
    assert all(float(line.rsplit(" ", 1)[1]) > 0 for line in samples)
