"""The serving side of ``vllm-kt bench --load PROMPTS:CONCURRENCY``: each system behind
``vllm serve`` (CUDA graphs at vLLM's default compilation), driven by vLLM's own load
generator ``vllm bench serve`` with random prompts, so throughput, latency percentiles
and failed requests come from the tool vLLM users already trust."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vllm_kt_tools.bench.engine_runs import RunSpec
from vllm_kt_tools.bench.peers import SGLANG_PEER, SglangKt, check_sglang_run, engine_cli_flags
from vllm_kt_tools.bench.routing import TEMPERATURE
from vllm_kt_tools.support import process_groups
from vllm_kt_tools.support.server import VLLMServer, vllm_command

SERVED_NAME = "bench"
PERCENTILES = "50,90,99"
# Figures kept from vLLM's result file (percentile keys follow PERCENTILES).
SUMMARY_KEYS = (
    "completed",
    "failed",
    "duration",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    *(f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "p50", "p90", "p99")),
)


def serve_args(spec: RunSpec, max_model_len: int) -> list[str]:
    """``vllm serve`` flags equal to the engine mode's settings for ``spec``."""
    args = [
        "--served-model-name",
        SERVED_NAME,
        "--load-format",
        spec.load_format,
        "--max-model-len",
        str(max_model_len),
        "--gpu-memory-utilization",
        str(spec.gpu_memory_utilization),
        "--no-enable-prefix-caching",
        "--seed",
        "0",
    ]
    if spec.enforce_eager:
        args.append("--enforce-eager")
    if spec.cpu_offload_gb:
        args += ["--cpu-offload-gb", str(spec.cpu_offload_gb)]
    if spec.max_num_batched_tokens:
        args += ["--max-num-batched-tokens", str(spec.max_num_batched_tokens)]
    args += engine_cli_flags(spec.engine_args)
    if spec.system == "kt-hybrid":
        args += ["--quantization", "kt-hybrid"]
    return args


def bench_serve_command(
    base_url: str, model: str, prompts: int, concurrency: int, input_len: int, output_len: int, out: Path
) -> list[str]:
    return [
        *vllm_command(),
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        base_url,
        "--model",
        SERVED_NAME,
        "--tokenizer",
        model,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--ignore-eos",
        "--temperature",  # sampled, as the engine runs (bench/routing.py)
        str(TEMPERATURE),
        "--num-prompts",
        str(prompts),
        "--max-concurrency",
        str(concurrency),
        "--seed",
        "0",
        "--disable-tqdm",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        PERCENTILES,
        "--save-result",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
    ]


@dataclass(frozen=True)
class Load:
    """One load: ``prompts`` requests at ``concurrency``, their lengths, where logs go."""

    prompts: int
    concurrency: int
    input_len: int
    output_len: int
    log_dir: Path
    timeout_s: int

    @property
    def max_model_len(self) -> int:
        return self.input_len + self.output_len + 16


def served_run_record(spec: RunSpec) -> dict[str, Any]:
    """What a run behind a server records of its configuration: system, method, and the
    variant, environment, offload and engine arguments where set."""
    result: dict[str, Any] = {"system": spec.system, "method": spec.method}
    for key in ("variant", "env", "cpu_offload_gb", "engine_args", "max_num_batched_tokens"):
        if getattr(spec, key):
            result[key] = getattr(spec, key)
    return result


def load_run(spec: RunSpec, load: Load) -> dict[str, Any]:
    """One system behind ``vllm serve`` under ``vllm bench serve``; the summary of its result."""
    name = f"load-{spec.name}"
    result = served_run_record(spec)
    args = serve_args(spec, load.max_model_len)
    server = VLLMServer(spec.model, args, env=spec.env, log_path=load.log_dir / f"{name}-serve.log")
    return measure_load(server, name, spec.model, result, load)


def sglang_server(config: SglangKt, context_length: int, log_path: Path) -> VLLMServer:
    """sglang-kt's own server (its Python, ``SGLANG_PYTHON``), started and stopped as
    ``vllm serve`` is (its ``/health`` answers the same way)."""
    server = VLLMServer(config.model, [], env={}, log_path=log_path)
    server.command = replace(config, port=server.port, context_length=context_length).command()
    return server


def sglang_load_run(config: SglangKt, load: Load) -> dict[str, Any]:
    """sglang-kt's server under the same ``vllm bench serve`` (its OpenAI-compatible
    completions endpoint). Written for the GPU host; never run here."""
    name = f"load-{config.name}"
    log_path = load.log_dir / f"{name}-serve.log"
    server = sglang_server(config, load.max_model_len, log_path)
    result: dict[str, Any] = {
        "system": SGLANG_PEER,
        "method": config.method,
        "variant": config.name,
        "command": server.command,
    }
    return check_sglang_run(measure_load(server, name, config.model, result, load), log_path)


def measure_load(server: VLLMServer, name: str, model: str, result: dict[str, Any], load: Load) -> dict[str, Any]:
    """``vllm bench serve`` against ``server`` once it answers; its summary into ``result``."""
    print(f"[bench] {name}: its server, then {load.prompts} requests at concurrency {load.concurrency}", flush=True)
    try:
        with server:
            result.update(bench_serve(server.base_url, name, model, load))
    except (RuntimeError, TimeoutError) as exc:
        result.update(prompts=load.prompts, concurrency=load.concurrency, error=str(exc)[-1500:])
    return result


def bench_serve(base_url: str, name: str, model: str, load: Load) -> dict[str, Any]:
    """``vllm bench serve`` against a server that answers at ``base_url``: the summary of its
    result (an ``error`` where the client failed). A ``--server-engine`` sitting sends the
    load to the server it measured (one start per system, not two)."""
    result: dict[str, Any] = {"prompts": load.prompts, "concurrency": load.concurrency}
    out = load.log_dir / f"{name}.json"
    client_log = load.log_dir / f"{name}-client.log"
    started = time.perf_counter()
    command = bench_serve_command(base_url, model, load.prompts, load.concurrency, load.input_len, load.output_len, out)
    try:
        with open(client_log, "w") as log:
            client = process_groups.start(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
            try:
                code = client.wait(timeout=load.timeout_s)
            finally:
                process_groups.stop(client)
    except subprocess.TimeoutExpired as exc:
        result["error"] = str(exc)[-1500:]
        return result
    if code != 0 or not out.exists():
        result["error"] = f"vllm bench serve exited {code}; see {client_log}"
        return result
    full = json.loads(out.read_text())
    result.update({key: _rounded(full[key]) for key in SUMMARY_KEYS if key in full})
    errors = [e for e in full.get("errors", []) if e]
    if errors:
        result["first_errors"] = errors[:3]
    print(
        f"[bench] {name}: done in {time.perf_counter() - started:.0f} s: {result.get('completed')} completed, "
        f"{result.get('failed')} failed, {result.get('output_throughput')} output tok/s, "
        f"p99 TTFT {result.get('p99_ttft_ms')} ms",
        flush=True,
    )
    return result


def _rounded(value: Any) -> Any:
    return round(value, 2) if isinstance(value, float) else value
