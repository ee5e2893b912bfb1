"""`vllm serve --quantization kt-hybrid` (the real CLI and OpenAI server) answers the
completions and chat endpoints through the openai client with plain vLLM's tokens, with
``--enforce-eager`` too on AMX CPUs, where plain vLLM dies."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest
import torch
from kt_testing.engines import FAST_COMPILE_CACHE, clean_env
from kt_testing.openai_client import SERVE_ARGS, ask, burst, burst_prompts

from vllm_kt_tools.cli.demo import serve_command_line
from vllm_kt_tools.support.server import VLLMServer, activated_env, free_port

pytestmark = pytest.mark.engine

EAGER = ["--enforce-eager"]
# Python's fault handler prints this line when a process dies of SIGILL (vLLM's own log line
# for the dead worker reads its exit code -4, or None where it looked before the exit).
SIGILL = "Fatal Python error: Illegal instruction"


def serve(model: Path, log: Path, kt: dict[str, str] | None, args: list[str] | None = None) -> dict:
    """The user's command, at vLLM's default compilation (its AOT compile cache included)
    unless ``args`` (e.g. EAGER) say otherwise."""
    args = [*SERVE_ARGS, *(args or []), *(["--quantization", "kt-hybrid"] if kt is not None else [])]
    env = clean_env(**(kt or {"VLLM_PLUGINS": ""}))
    for name in FAST_COMPILE_CACHE:
        env.pop(name)
    with VLLMServer(model, args, env=env, log_path=log) as server:
        return ask(server)


@pytest.fixture(scope="module")
def plain_server(tiny_model, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Plain vLLM's answers (plugin not loaded, default compilation): one server for every
    test here, asked the questions (``ask``) and the prompts sent together (``burst``)."""
    model = tiny_model("qwen3_moe")
    env = clean_env(VLLM_PLUGINS="")
    for name in FAST_COMPILE_CACHE:
        env.pop(name)
    log = tmp_path_factory.mktemp("plain") / "plain.log"
    with VLLMServer(model, SERVE_ARGS, env=env, log_path=log) as server:
        return {"ask": ask(server), "burst": burst(server, burst_prompts())}


@pytest.fixture(scope="module")
def plain(plain_server: dict) -> dict:
    return plain_server["ask"]


def _amx_cpu_build() -> bool:
    from vllm.platforms import current_platform

    # torch's probe is the one vLLM's CPU build asks before it picks its AMX kernels
    return bool(current_platform.is_cpu() and torch.cpu._is_amx_tile_supported())


@pytest.mark.skipif(
    not _amx_cpu_build(),
    reason="needs vLLM's CPU build on a CPU with AMX tiles: elsewhere vLLM's kernels use no AMX, so "
    "--enforce-eager needs no tile permission and plain vLLM does not die",
)
def test_enforce_eager_serves_on_amx(tiny_model, plain: dict, tmp_path: Path) -> None:
    """vLLM 0.32's CPU build runs AMX instructions (its attention kernel, the first) without
    asking Linux for tile permission; under torch.compile an earlier oneDNN matmul asks, with
    --enforce-eager nothing does. Plain vLLM dies of SIGILL at the first request — so this
    test fails, and the workaround can go, once vLLM asks itself — and kt-hybrid, which asks
    when it builds its layers (vllm_compat.ask_for_amx_tiles), answers with plain vLLM's
    (compiled) tokens."""
    model = tiny_model("qwen3_moe")
    log = tmp_path / "plain-eager.log"
    env = clean_env(VLLM_PLUGINS="", PYTHONFAULTHANDLER="1")
    with VLLMServer(model, [*SERVE_ARGS, *EAGER], env=env, log_path=log) as server:
        try:
            answered = bool(ask(server))
        except openai.APIError:  # the connection dropped, or a 500 from the dead engine
            answered = False
    assert not answered, "plain vLLM answered with --enforce-eager: does vLLM ask for AMX tiles itself now?"
    assert SIGILL in log.read_text(), log.read_text()[-3000:]

    hybrid_log = tmp_path / "kt-eager.log"  # half of the experts on vLLM's MoE kernel, half on kt-kernel
    hybrid = serve(model, hybrid_log, {"KT_NUM_GPU_EXPERTS": "4", "PYTHONFAULTHANDLER": "1"}, EAGER)
    assert "enforce_eager=True" in hybrid_log.read_text() and SIGILL not in hybrid_log.read_text()
    assert hybrid == plain


def test_openai_server_answers_like_plain_vllm(tiny_model, plain: dict, tmp_path: Path) -> None:
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
    assert len(hybrid["completion_ids"]) == 20
    assert hybrid == plain
    assert hybrid["chat_text"].startswith("Paris is the capital of France.")


def test_metrics_log_line_and_prometheus(tiny_model, tmp_path: Path) -> None:
    """KT_METRICS_INTERVAL: the engine logs per-layer CPU/GPU/wait times, and with vLLM's
    multiprocess metrics (two API servers) the counters appear on /metrics."""
    import time
    import urllib.request

    from openai import OpenAI

    from vllm_kt_plugin.hybrid.metrics import LARGE_FORWARD_TOKENS
    from vllm_kt_plugin.hybrid.staging.plan import CPU_PATH
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


def test_kt_hybrid_scheduler_gathers_prompts_sent_together(tiny_model, plain_server: dict, tmp_path: Path) -> None:
    """kt-hybrid's scheduler (``--scheduler-cls``, hybrid/scheduler.py) behind `vllm serve`: 8
    prompts sent 0.1 s apart, each large enough to stream the whole layer (forced from 16
    tokens on this build), run as one forward, where vLLM's own scheduler runs the first alone
    as soon as it arrives (more than one forward: so this can fail); greedy tokens are plain
    vLLM's either way. vLLM's steps: the large-forward log lines (KT_METRICS_INTERVAL), queued
    after the burst began (the monotonic clock is the host's)."""
    from vllm_kt_plugin.hybrid.scheduler import GATHERED
    from vllm_kt_plugin.hybrid.staging.plan import WHOLE_LAYER_PATH
    from vllm_kt_plugin.settings.catalogue import GATHERING_SCHEDULER
    from vllm_kt_tools.bench.report import LARGE_FORWARD_LINE

    model = tiny_model("qwen3_moe")
    prompts = burst_prompts()
    # 3 s: the 8 arrivals span 0.7 s, and this box is shared (a lone prompt waits the whole window)
    kt = {"KT_NUM_GPU_EXPERTS": "4", "KT_STAGING_MIN_TOKENS": "16", "KT_METRICS_INTERVAL": "3600"}
    env = clean_env(**kt, KT_STAGING_GATHER_MS="3000")
    forwards = {}
    for name, scheduler in (("vllm", []), ("kt-hybrid", ["--scheduler-cls", GATHERING_SCHEDULER])):
        log = tmp_path / f"{name}-scheduler.log"
        args = [*SERVE_ARGS, "--quantization", "kt-hybrid", *scheduler]
        with VLLMServer(model, args, env=env, log_path=log) as server:
            began = time.monotonic()
            answers = burst(server, prompts)
        assert [a["token_ids"] for a in answers] == [a["token_ids"] for a in plain_server["burst"]], name
        text = log.read_text()
        forwards[name] = [(int(n), path) for n, path, at in LARGE_FORWARD_LINE.findall(text) if float(at) >= began]
        tokens = sum(a["prompt_tokens"] for a in answers)
        assert all(a["prompt_tokens"] >= 16 for a in answers)
        if scheduler:
            assert forwards[name] == [(tokens, WHOLE_LAYER_PATH)], forwards
            assert f"{GATHERED} 8 prompts ({tokens} tokens) into one step" in text, text[-3000:]
        else:
            assert len(forwards[name]) > 1 and GATHERED not in text, forwards
