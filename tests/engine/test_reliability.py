"""Reliability of `vllm serve --quantization kt-hybrid` on vLLM's CPU build, one server
start for all of it: vLLM's own load generator (`vllm bench serve`, random dataset) with
prompts longer than the scheduler's token budget, clients that disconnect mid-stream,
and the memory of the server's processes over 4,000 more requests (its growth per
request fitted as a slope after a warm-up). A greedy probe gives
the same tokens before, between and after."""

from __future__ import annotations

import json
import statistics
import subprocess
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from kt_testing.engines import clean_env
from openai import OpenAI

from vllm_kt_tools.support.server import VLLMServer, process_tree_rss_bytes, vllm_command

pytestmark = pytest.mark.engine

MODEL_NAME = "tiny-moe"
BATCH_TOKENS = 128  # --max-num-batched-tokens: longer prompts are prefilled in chunks
SERVE_ARGS = [
    "--served-model-name",
    MODEL_NAME,
    "--max-model-len",
    "512",
    "--max-num-batched-tokens",
    str(BATCH_TOKENS),
    "--quantization",
    "kt-hybrid",
]
KT = {"KT_NUM_GPU_EXPERTS": "4"}  # half of each layer's experts on kt-kernel (BF16)
PROBE = "A mixture of experts"
LOAD_REQUESTS, LOAD_CONCURRENCY = 200, 16
STREAMS, ABORT_EVERY = 30, 3  # every third streaming client hangs up: 10 of 30
STREAM_TOKENS = 96
# The leak check: short requests after a warm-up, the server processes' RSS sampled every
# LEAK_SAMPLE_EVERY requests, a least-squares slope (MiB per request) fitted to the samples
# after the warm-up. Measured on the 2-core dev box (shared with other engines), this test's
# flow run for 2,500 such requests with no warm-up (`pytest -s tests/engine/test_reliability.py`,
# LEAK_WARMUP_REQUESTS=0, LEAK_REQUESTS=2500): slope 0.077 MiB per request over requests
# 0-500, then 0.019-0.027 over any 1,000 after it (0.019 over 500-1,500) — the 0.085 MiB per
# request once read from requests 100-500 (34 MiB) was this warm-up. The growth is vLLM's
# worker process (API server and engine core flat), and plain vLLM grows alike: after vLLM's
# load generator, 2,000 short requests grew the worker by 85 MiB without the plugin and 106
# MiB with it, both by ever smaller steps (per 1,000: plain 0.081 then 0.004, kt-hybrid 0.095
# then 0.011 MiB per request; exploration script, same server arguments). glibc's per-thread
# arenas make RSS jump by tens of MiB with no leak behind it, hence MALLOC_ARENA_MAX=2.
# A 500-request warm-up was too short: one run then measured 0.041 over the next 1,000, most
# of it in their first 200 (36 MiB); past request 1,000 that run grew 0.022.
# A window of 1,000 was too short on the AVX-512 dev box (CI measured 0.050 there): the growth
# is the worker's glibc main heap (`[heap]` in /proc/PID/smaps) raising its high-water mark in
# steps of 8-20 MiB as new batch shapes fragment it, and 1,000 requests catch one to three of
# them (0.037 and 0.050). In one run of 10,000 requests it rose 10 MiB from request 1,000 to
# 3,000, 20 MiB between 7,000 and 8,000, and nothing else: no growth per request.
# Measured there over the 3,000 requests after a 1,000-request warm-up (the flow below, RSS every
# 100 requests, an exploration script): kt-hybrid 0.0175 and 0.0036 (0.0093 the steepest 3,000
# of the 10,000-request run), plain vLLM 0.0098 MiB per request; this test, run alone: 0.0168.
LEAK_WARMUP_REQUESTS, LEAK_REQUESTS, LEAK_SAMPLE_EVERY = 1000, 3000, 50
# Bound: the measured 0.0175 MiB per request plus a margin of 0.0225 (four more heap steps of
# 16 MiB in the 3,000 requests); a leak of 40 KiB per request fails, and the 0.085 MiB per
# request the issue feared.
RSS_SLOPE_BOUND_MIB_PER_REQUEST = 0.04
SERVER_ENV = {**KT, "MALLOC_ARENA_MAX": "2"}


def probe(client: OpenAI) -> list[int]:
    completion = client.completions.create(
        model=MODEL_NAME,
        prompt=PROBE,
        max_tokens=16,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    return list(completion.choices[0].model_extra["token_ids"])


def bench_serve(server: VLLMServer, model: Path, out: Path) -> dict:
    """vLLM's own load generator: random prompts of 26..486 tokens (most above the
    128-token batch budget, so prefilled in chunks), 8 new tokens each."""
    command = [
        *vllm_command(),
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        server.base_url,
        "--model",
        MODEL_NAME,
        "--tokenizer",
        str(model),
        "--dataset-name",
        "random",
        "--random-input-len",
        "256",
        "--random-range-ratio",
        "0.9",
        "--random-output-len",
        "8",
        "--ignore-eos",
        "--num-prompts",
        str(LOAD_REQUESTS),
        "--max-concurrency",
        str(LOAD_CONCURRENCY),
        "--seed",
        "0",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
    ]
    proc = subprocess.run(command, capture_output=True, text=True, env=clean_env(), timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text())


def stream(client: OpenAI, index: int) -> str:
    """One streaming completion; every ABORT_EVERY-th client hangs up after two chunks. A
    finished stream is judged by its usage chunk: a server that is behind sends several
    tokens in one chunk (seen with the machine busy: 75 and 87 chunks for 96 tokens)."""
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=f"{PROBE} {index}",
        max_tokens=STREAM_TOKENS,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = tokens = 0
    for chunk in response:
        chunks += 1
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if index % ABORT_EVERY == 0 and chunks == 2:
            response.close()  # the client disconnects mid-stream
            return "aborted"
    return "finished" if tokens == STREAM_TOKENS else f"short ({tokens} tokens in {chunks} chunks)"


def short_request(client: OpenAI, index: int) -> int:
    completion = client.completions.create(
        model=MODEL_NAME,
        prompt=" ".join([PROBE] * (1 + index % 40)),  # 4..160 tokens: some prefilled in chunks
        max_tokens=4,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    return completion.usage.completion_tokens


def test_load_aborts_and_memory(tiny_model, tmp_path: Path) -> None:
    model = tiny_model("qwen3_moe")
    log = tmp_path / "serve.log"
    with VLLMServer(model, SERVE_ARGS, env=clean_env(**SERVER_ENV), log_path=log) as server:
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="EMPTY", max_retries=0)
        before = probe(client)

        # 1. vLLM's load generator: every request completes.
        load = bench_serve(server, model, tmp_path / "load.json")
        assert (load["completed"], load["failed"]) == (LOAD_REQUESTS, 0), [e for e in load["errors"] if e][:3]
        longer = sum(n > BATCH_TOKENS for n in load["input_lens"])
        assert longer >= LOAD_REQUESTS // 2, load["input_lens"]  # chunked prefill did happen
        assert probe(client) == before

        # 2. Clients that hang up mid-stream leave the server healthy and correct.
        with ThreadPoolExecutor(8) as pool:
            outcomes = list(pool.map(lambda i: stream(client, i), range(STREAMS)))
        assert outcomes.count("aborted") == STREAMS // ABORT_EVERY, outcomes
        assert outcomes.count("finished") == STREAMS - STREAMS // ABORT_EVERY, outcomes
        # The server stopped generating for the clients that hung up (vLLM counts no finish
        # reason for them, but their tokens stop), and nothing is left running.
        aborted = STREAMS // ABORT_EVERY
        completed_tokens = LOAD_REQUESTS * 8 + 2 * 16 + (STREAMS - aborted) * STREAM_TOKENS
        generated = metric(server, "vllm:generation_tokens_total")
        assert completed_tokens <= generated < completed_tokens + aborted * STREAM_TOKENS // 2, generated
        assert metric(server, "vllm:num_requests_running") == 0
        assert metric(server, "vllm:request_success_total", 'finished_reason="error"') == 0
        assert server.healthy()
        assert probe(client) == before

        # 3. Short requests: after a warm-up, the server's memory grows by less than the
        # bound per request (a least-squares slope over the samples).
        with ThreadPoolExecutor(8) as pool:
            warmup = list(pool.map(lambda i: short_request(client, i), range(LEAK_WARMUP_REQUESTS)))
        assert warmup == [4] * LEAK_WARMUP_REQUESTS
        samples = [(0, process_tree_rss_bytes(server.pid) / 2**20)]
        with ThreadPoolExecutor(8) as pool:
            for start in range(0, LEAK_REQUESTS, LEAK_SAMPLE_EVERY):
                chunk = range(LEAK_WARMUP_REQUESTS + start, LEAK_WARMUP_REQUESTS + start + LEAK_SAMPLE_EVERY)
                assert list(pool.map(lambda i: short_request(client, i), chunk)) == [4] * LEAK_SAMPLE_EVERY
                samples.append((start + LEAK_SAMPLE_EVERY, process_tree_rss_bytes(server.pid) / 2**20))
        slope = statistics.linear_regression(*zip(*samples, strict=True)).slope
        print(f"server RSS (MiB) every {LEAK_SAMPLE_EVERY} requests after warm-up: {[round(m) for _, m in samples]}")
        print(f"RSS slope after {LEAK_WARMUP_REQUESTS} warm-up requests: {slope:.5f} MiB per request")
        assert slope < RSS_SLOPE_BOUND_MIB_PER_REQUEST, samples
        assert probe(client) == before
        text = log.read_text()  # read before the shutdown, whose own messages are vLLM's
        assert "kt-hybrid" in text and "Traceback" not in text, text[-3000:]


def metric(server: VLLMServer, name: str, label: str = "") -> float:
    """The sum of a Prometheus metric over its series (those with ``label``) on /metrics."""
    with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    series = [line for line in lines if line.startswith((f"{name}{{", f"{name} ")) and label in line]
    assert series, f"{name} not on /metrics"
    return sum(float(line.rsplit(" ", 1)[1]) for line in series)
