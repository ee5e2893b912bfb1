"""The engine workload through a server (``vllm-kt bench --server-engine``): decode at
batch 1 and 16, 8 prompts of 1,024 tokens and one long prompt, the same figures and
formulas as ``engine_child.run_engine``, sent to a server's OpenAI-compatible
``/v1/completions`` instead of vLLM's ``LLM``.

Why a second way to measure the same thing: sglang-kt (KTransformers' SGLang) has no
vLLM ``LLM`` to call, only its server, so the head-to-head decode and prefill figures of
issue 27 come from its server; kt-hybrid (and any vLLM peer) behind ``vllm serve`` is
measured the same way beside it, so both sides carry the same HTTP costs.

Prompts are token ids (no tokenizer on either side), sampled at temperature 1 with
``ignore_eos``; each decode request of a batch has its own seed, so that the 16 copies of one
prompt sample apart, reproducibly (``bench/routing.py``). Each response's
``usage.completion_tokens`` is checked: a server that stopped early would inflate the rate.
"""

from __future__ import annotations

import json
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_kt_tools.bench import decode_timeline, routing
from vllm_kt_tools.bench.engine_child import (
    MODEL_LOAD_RE,
    TTFT_SEEDS,
    decode_rate,
    decode_repeats,
    decode_summary,
    random_prompts,
)
from vllm_kt_tools.bench.engine_runs import LONG_PROMPT_TOKENS
from vllm_kt_tools.bench.load_runs import Load, bench_serve
from vllm_kt_tools.bench.routing import TEMPERATURE
from vllm_kt_tools.bench.timeline import MIN_TOKENS, NoTimeline, ServerTimeline, describe, timeline_record

if TYPE_CHECKING:
    from vllm_kt_tools.bench.timeline import EngineTimeline
    from vllm_kt_tools.support.server import VLLMServer

    Timeline = EngineTimeline | ServerTimeline | NoTimeline

SERVED_NAME = "bench"  # both servers are started with --served-model-name bench


@dataclass(frozen=True)
class ServerWorkload:
    """What one server is asked: the engine mode's sizes (smaller in tests)."""

    vocab: int
    max_model_len: int
    decode_tokens: int = 64
    decode_repeats: int = 5
    prefill_len: int = 1024
    long_len: int = LONG_PROMPT_TOKENS
    timeout_s: float = 1200.0


def complete(base_url: str, prompt: list[int], max_tokens: int, seed: int | None, timeout_s: float) -> int:
    """One sampled completion of ``max_tokens`` tokens (seeded where ``seed`` is given);
    returns the tokens the server says it generated."""
    body: dict[str, Any] = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": TEMPERATURE,
        "ignore_eos": True,
    }
    if seed is not None:
        body["seed"] = seed
    request = urllib.request.Request(
        f"{base_url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        answer = json.loads(response.read())
    return int(answer["usage"]["completion_tokens"])


def timed_requests(
    base_url: str, prompts: list[list[int]], max_tokens: int, seed: int | None, timeout_s: float
) -> tuple[float, list[float]]:
    """Seconds for all ``prompts`` sent at once (one request each, seeds ``seed``,
    ``seed + 1``, ..., or none) to come back, and each one's seconds from the start (with one
    token asked: its time to first token); each must have generated ``max_tokens``."""
    started = time.perf_counter()

    def one(i: int, prompt: list[int]) -> tuple[int, float]:
        generated = complete(base_url, prompt, max_tokens, None if seed is None else seed + i, timeout_s)
        return generated, time.perf_counter() - started

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        answers = [future.result() for future in [pool.submit(one, i, p) for i, p in enumerate(prompts)]]
    seconds = time.perf_counter() - started
    generated = [n for n, _ in answers]
    if any(n != max_tokens for n in generated):
        raise RuntimeError(f"asked {max_tokens} tokens per request (ignore_eos), the server generated {generated}")
    return seconds, [s for _, s in answers]


def timed_batch(base_url: str, prompts: list[list[int]], max_tokens: int, seed: int | None, timeout_s: float) -> float:
    """``timed_requests``' seconds for the whole batch."""
    return timed_requests(base_url, prompts, max_tokens, seed, timeout_s)[0]


def measure(base_url: str, work: ServerWorkload, into: dict[str, Any], timeline: Timeline | None = None) -> None:
    """The engine mode's figures (``engine_child.run_engine``'s keys) through ``base_url``,
    into ``into`` as each is measured: a server that fails a later request (say, at a long
    prompt) keeps the figures it gave. ``timeline``: kt-hybrid's, told each prefill's name."""
    timeline = timeline or NoTimeline()
    decode = work.decode_tokens
    into["sampling"] = {"temperature": TEMPERATURE, "seed": "one per decode request, none for prefills"}
    into["via"] = "server"

    def rates(batch: int, seed: int) -> tuple[list[float], int]:
        prompts = random_prompts(1, 32, work.vocab, seed) * batch  # one prompt: only sampling sets them apart
        timed_batch(base_url, prompts, 4, seed * 1000, work.timeout_s)  # warm-up

        def pair() -> float | None:
            short = timed_batch(base_url, prompts, decode, seed * 1000 + 100, work.timeout_s)
            long = timed_batch(base_url, prompts, 2 * decode, seed * 1000 + 200, work.timeout_s)
            return decode_rate(batch, decode, short, long)

        return decode_repeats(pair, work.decode_repeats)

    timeline.collect_decode()  # forget the start-up's forwards
    for batch, seed in ((1, 1), (16, 2)):
        into.update(decode_summary(f"decode_bs{batch}", *rates(batch, seed=seed)))
        decode_steps = decode_timeline.summarize(timeline.collect_decode(), batch)  # armed: --decode-timeline
        if decode_steps is not None:
            into.setdefault("decode_timeline", {})[str(batch)] = decode_steps
    prefill_len = min(work.prefill_len, work.max_model_len - 2)
    # Prefills go unseeded: their one sampled token routes nothing that matters, and vLLM 0.32's CPU
    # build fails a seeded request whose prompt is chunked ("CPU Generator does not use offset").
    # The prompts are the engine mode's (same seeds).

    def prefill(label: str, count: int, length: int, seed: int) -> float:
        return prefill_requests(label, count, length, seed)[0]

    def prefill_requests(label: str, count: int, length: int, seed: int) -> tuple[float, list[float]]:
        timeline.mark(label)
        return timed_requests(base_url, random_prompts(count, length, work.vocab, seed), 1, None, work.timeout_s)

    prefill(f"8 x {prefill_len} warm-up", 8, prefill_len, 3)
    prefill_s, firsts = prefill_requests(f"8 x {prefill_len}", 8, prefill_len, 4)
    into.update(prefill_tok_s=round(8 * prefill_len / prefill_s, 1), prefill_prompt_tokens=prefill_len)
    # each prompt's first token (one asked), from when the 8 were sent: what holding them costs
    into.update(prefill_ttft_mean_s=round(statistics.mean(firsts), 4), prefill_ttft_max_s=round(max(firsts), 4))
    ttft_s = statistics.median(prefill(f"one {prefill_len} alone, seed {s}", 1, prefill_len, s) for s in TTFT_SEEDS)
    into["ttft_one_prompt_s"] = round(ttft_s, 4)
    long_len = min(work.long_len, work.max_model_len - 2)
    prefill(f"one {long_len} warm-up", 1, long_len, 5)
    long_s = prefill(f"one {long_len}", 1, long_len, 6)
    into.update(prefill_long_tok_s=round(long_len / long_s, 1), prefill_long_prompt_tokens=long_len)


def server_engine_run(
    server: VLLMServer,
    name: str,
    result: dict[str, Any],
    work: ServerWorkload,
    routed: tuple[int, int] | None = None,
    load: Load | None = None,
    model: str = "",
) -> dict[str, Any]:
    """``measure`` against ``server`` once it answers, into ``result`` (an ``error`` where the
    server did not start or a request failed: the sitting goes on with the next system).
    ``routed`` = (experts, top-k) of a vLLM server started with ``routing.server_recording()``:
    the routing its workload made is recorded as the engine mode's is, and kt-hybrid's
    per-forward timeline read. ``load``: then ``vllm bench serve`` against the same server,
    into ``result["load"]`` (``model``: the directory its tokenizer comes from)."""
    print(f"[bench] {name}: its server, then the engine workload through /v1/completions", flush=True)
    started = time.perf_counter()
    try:
        with server:
            since = routing.server_counts(server.base_url) if routed else None
            timeline = ServerTimeline(server.base_url, min(MIN_TOKENS, work.prefill_len)) if routed else None
            try:
                measure(server.base_url, work, result, timeline)
            finally:  # what a failed request left recorded is the most telling part
                if timeline is not None:
                    steps = timeline.collect()
                    if steps:
                        result["timeline"] = timeline_record(steps, timeline.split_costs())
            if routed:
                result["routing"] = routing.counted_routing(routing.server_counts(server.base_url), *routed, since)
            if load is not None:
                result["load"] = bench_serve(server.base_url, f"load-{name}", model, load)
    except (RuntimeError, TimeoutError, OSError, KeyError, ValueError) as exc:  # urllib's errors are OSErrors
        result["error"] = f"{type(exc).__name__}: {str(exc)[-1500:]}"
    if routed and "gpu_weight_gb" not in result:  # a vLLM server: the weight memory it reported
        loaded = MODEL_LOAD_RE.findall(server.log_path.read_text(errors="replace")) if server.log_path.is_file() else []
        result["gpu_weight_gb"] = float(loaded[0]) if loaded else None
    figures = ("decode_bs1_tok_s", "decode_bs16_tok_s", "prefill_tok_s", "ttft_one_prompt_s", "prefill_long_tok_s")
    outcome = ", ".join(f"{name} {result.get(name)}" for name in figures)
    if "error" in result:
        outcome += f"; {result['error']}"
    print(f"[bench] {name}: done in {time.perf_counter() - started:.0f} s: {outcome}", flush=True)
    for step in result.get("timeline", {}).get("summary", []):
        print(f"[bench] {name}: {describe(step)}", flush=True)
    for batch, summary in result.get("decode_timeline", {}).items():
        print(f"[bench] {name}: {decode_timeline.describe(int(batch), summary)}", flush=True)
    return result
