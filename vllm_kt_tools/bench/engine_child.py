"""One engine, measured in a process of its own (``run_in_child`` -> ``run_engine``):
decode tok/s at batch 1 and 16, prefill tok/s (8 prompts x 1,024 tokens, and one long
prompt), the time to first token of one 1,024-token prompt alone, start-up time, the GPU
weight memory vLLM reports and the routing the workload made (``bench/routing.py``); the
same engine settings for every system."""

from __future__ import annotations

import json
import os
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vllm_kt_tools.bench import decode_timeline, routing
from vllm_kt_tools.bench.engine_runs import LONG_PROMPT_TOKENS, RunSpec
from vllm_kt_tools.bench.peers import engine_kwargs
from vllm_kt_tools.bench.report import large_forwards, layer_metrics
from vllm_kt_tools.bench.shapes import model_sizes
from vllm_kt_tools.bench.timeline import MIN_TOKENS, EngineTimeline, NoTimeline, describe, timeline_record
from vllm_kt_tools.support.child import run_child
from vllm_kt_tools.support.engine_lock import engine_lock, stop_engine

TTFT_SEEDS = (7, 8, 9)  # one 1,024-token prompt alone, three times: its time to first token


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` prompts of random token ids (clear of the vocabulary's special ends), one
    generator per call: the same prompts for a seed in either way of measuring."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(count)]


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": ids} for ids in random_prompts(count, length, vocab, seed)]


def _decode_prompts(batch: int, vocab: int, seed: int) -> list[dict[str, list[int]]]:
    """One 32-token prompt for every sequence of a decode batch: what routes the batch's
    tokens apart is then the sampling alone, which the recorded routing checks (greedy
    decoding would route all of them alike)."""
    return _prompts(1, 32, vocab, seed) * batch


def run_engine(**fields: Any) -> dict[str, Any]:
    """Start one vLLM engine and measure it (runs in the child process)."""
    spec = RunSpec(**fields)
    os.environ.update(spec.env)
    from vllm import LLM, SamplingParams  # deferred: only the child process starts an engine

    routing.install()  # here and, through support.child's preload, in the spawned engine processes

    extra: dict[str, Any] = engine_kwargs(spec.engine_args)
    if spec.system == "kt-hybrid":
        extra["quantization"] = "kt-hybrid"
    if spec.cpu_offload_gb:
        extra["cpu_offload_gb"] = spec.cpu_offload_gb
    if spec.max_num_batched_tokens:
        extra["max_num_batched_tokens"] = spec.max_num_batched_tokens
    with engine_lock():  # other engines of this GPU start and stop in turn (VLLM_KT_ENGINE_LOCK)
        started = time.perf_counter()  # not counting the wait for the lock
        llm = LLM(
            model=spec.model,
            load_format=spec.load_format,
            skip_tokenizer_init=True,
            max_model_len=min(spec.max_model_len, max_positions(spec.model)),
            max_num_seqs=16,
            enable_prefix_caching=False,
            gpu_memory_utilization=spec.gpu_memory_utilization,
            enforce_eager=spec.enforce_eager,
            seed=0,
            **extra,
        )
        startup_s = time.perf_counter() - started
    vocab = llm.llm_engine.model_config.get_vocab_size()
    prefill_len = min(1024, llm.llm_engine.model_config.max_model_len - 2)
    routed_at_start = routing.engine_counts(llm)  # not the engine's own warm-up and graph capture

    def timed(prompts: list[dict[str, list[int]]], max_tokens: int) -> tuple[float, list[list[int]]]:
        # sampled, not greedy: independent tokens route like a real model's (bench/routing.py)
        params = SamplingParams(temperature=spec.temperature, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]

    def decode_rates(batch: int, seed: int) -> tuple[list[float], int, list[list[int]]]:
        """``decode_repeats`` of this batch, and the tokens of its last short run."""
        prompts = _decode_prompts(batch, vocab, seed)
        timed(prompts, 4)  # warm-up
        tokens: list[list[int]] = []

        def pair() -> float | None:
            short, tokens[:] = timed(prompts, spec.decode_tokens)
            long, _ = timed(prompts, 2 * spec.decode_tokens)
            return decode_rate(batch, spec.decode_tokens, short, long)

        return (*decode_repeats(pair, spec.decode_repeats), tokens)

    # each prefill's forwards, layer by layer, under its measurement's name; the decode steps (kt-hybrid only)
    timeline = EngineTimeline(llm, min(MIN_TOKENS, prefill_len)) if spec.system == "kt-hybrid" else NoTimeline()
    timeline.collect_decode()  # forget the start-up's forwards
    rates_bs1, discarded_bs1, tokens_bs1 = decode_rates(1, seed=1)
    decode_steps = {"1": decode_timeline.summarize(timeline.collect_decode(), 1)}
    rates_bs16, discarded_bs16, _ = decode_rates(16, seed=2)
    decode_steps["16"] = decode_timeline.summarize(timeline.collect_decode(), 16)
    decode_steps = {batch: summary for batch, summary in decode_steps.items() if summary is not None}
    long_len = min(LONG_PROMPT_TOKENS, llm.llm_engine.model_config.max_model_len - 2)

    def prefill(label: str, count: int, length: int, seed: int) -> float:
        timeline.mark(label)
        return timed(_prompts(count, length, vocab, seed=seed), 1)[0]

    prefill(f"8 x {prefill_len} warm-up", 8, prefill_len, 3)
    prefill_s = prefill(f"8 x {prefill_len}", 8, prefill_len, 4)
    # time to first token of one 1,024-token prompt alone (issue 28): median of three prompts
    ttft_s = statistics.median(prefill(f"one {prefill_len} alone, seed {s}", 1, prefill_len, s) for s in TTFT_SEEDS)
    prefill(f"one {long_len} warm-up", 1, long_len, 5)
    long_s = prefill(f"one {long_len}", 1, long_len, 6)
    steps, split_costs = timeline.collect(), timeline.split_costs()
    sizes = model_sizes(json.loads((Path(spec.model) / "config.json").read_text()))
    routed = routing.engine_routing(llm, sizes.num_experts, sizes.top_k, since=routed_at_start)
    stop_engine(llm)
    return {
        "startup_s": round(startup_s, 1),
        **decode_summary("decode_bs1", rates_bs1, discarded_bs1),
        **decode_summary("decode_bs16", rates_bs16, discarded_bs16),
        "prefill_tok_s": round(8 * prefill_len / prefill_s, 1),
        "prefill_prompt_tokens": prefill_len,
        "ttft_one_prompt_s": round(ttft_s, 4),
        "prefill_long_tok_s": round(long_len / long_s, 1),
        "prefill_long_prompt_tokens": long_len,
        "tokens_bs1": tokens_bs1[0],
        "sampling": {"temperature": spec.temperature, "engine_seed": 0},
        "routing": routed,
        **({"timeline": timeline_record(steps, split_costs)} if steps else {}),
        **({"decode_timeline": decode_steps} if decode_steps else {}),
    }


def decode_repeats(pair: Callable[[], float | None], repeats: int) -> tuple[list[float], int]:
    """Up to ``repeats`` rates from ``pair`` (one short and one long run; None where it
    was discarded: see ``decode_rate``), fewer where as many pairs were discarded, and the
    pairs discarded. Each decode figure is their median (AMXINT4 at batch 1 has varied by
    a third between sittings); the spread beside it says how far they agreed."""
    rates: list[float] = []
    discarded = 0
    while len(rates) < repeats and discarded < repeats:
        rate = pair()
        if rate is None:
            discarded += 1
        else:
            rates.append(rate)
    return rates, discarded


def decode_rate(batch: int, new_tokens: int, short_s: float, long_s: float) -> float | None:
    """Decode tokens per second from two runs of the same prompts, ``new_tokens`` and twice as
    many new tokens: their difference is ``new_tokens`` decode steps with no prefill or
    first-call cost in it (a 1-token baseline was seen to be slower than a 65-token run at
    batch 16). None where the short run took as long or longer: a stall in it outweighed
    the steps (seen on a 6-layer model, 32 tokens, batch 16)."""
    return batch * new_tokens / (long_s - short_s) if long_s > short_s else None


def decode_summary(name: str, rates: list[float], discarded: int = 0) -> dict[str, Any]:
    """The median of a decode measurement's repeats, and their spread: (max - min) / median,
    so a sitting's noise shows next to the figure; with the pairs of runs discarded (see
    ``decode_rate``), and None for both where every pair was."""
    median = statistics.median(rates) if rates else None
    return {
        f"{name}_tok_s": round(median, 2) if median is not None else None,
        f"{name}_spread": round((max(rates) - min(rates)) / median, 3) if median is not None else None,
        f"{name}_discarded_pairs": discarded,
        f"{name}_repeats_tok_s": [round(r, 2) for r in rates],
    }


def max_positions(model: str) -> int:
    hf_config = json.loads((Path(model) / "config.json").read_text())
    return int(hf_config.get("max_position_embeddings") or 2048)


MODEL_LOAD_RE = re.compile(r"Model loading took ([0-9.]+) GiB")


def run_in_child(spec: RunSpec, log_dir: Path, timeout_s: int) -> dict[str, Any]:
    """``run_engine`` in a fresh process; its log goes to ``log_dir/<name>.log``."""
    log_path = log_dir / f"{spec.name}.log"
    print(f"[bench] {spec.name}: starting (log: {log_path})", flush=True)
    started = time.perf_counter()
    target = f"{__name__}:run_engine"
    env = {**os.environ, **spec.env, **routing.child_env()}
    run = run_child(target, asdict(spec), env=env, timeout_s=timeout_s, log_path=log_path)
    log_text = run.log
    result: dict[str, Any] = {"system": spec.system, "method": spec.method, "enforce_eager": spec.enforce_eager}
    if spec.variant:
        result["variant"] = spec.variant
    result.update(run.result or {})
    loaded = MODEL_LOAD_RE.findall(log_text)
    result["gpu_weight_gb"] = float(loaded[0]) if loaded else None
    result["configured_gpu_weight_gb"] = spec.gpu_weight_gb
    if spec.cpu_offload_gb:
        result["cpu_offload_gb"] = spec.cpu_offload_gb
    if spec.engine_args:
        result["engine_args"] = spec.engine_args
    if spec.env:
        result["env"] = spec.env
    if spec.max_num_batched_tokens:
        result["max_num_batched_tokens"] = spec.max_num_batched_tokens
    metrics = layer_metrics(log_text)  # with KT_METRICS_INTERVAL set (e.g. --kt-env)
    if metrics:
        result["layer_metrics"] = metrics
    steps = large_forwards(log_text)
    if steps:
        result["large_forwards"] = steps
    if "decode_bs1_tok_s" not in result:
        result["error"] = f"exit {run.returncode}: " + " | ".join(log_text.strip().splitlines()[-5:])[-1500:]
    print(f"[bench] {spec.name}: done in {time.perf_counter() - started:.0f} s: {_summary(result)}", flush=True)
    for step in result.get("timeline", {}).get("summary", []):
        print(f"[bench] {spec.name}: {describe(step)}", flush=True)
    for batch, summary in result.get("decode_timeline", {}).items():
        print(f"[bench] {spec.name}: {decode_timeline.describe(int(batch), summary)}", flush=True)
    return result


def _decode_figure(result: dict[str, Any], name: str) -> str:
    if result[f"{name}_tok_s"] is None:
        return "not measured (every pair of runs discarded)"
    discarded = result.get(f"{name}_discarded_pairs", 0)
    note = f", {discarded} pairs discarded" if discarded else ""
    return f"{result[f'{name}_tok_s']} tok/s (spread {result[f'{name}_spread']:.0%}{note})"


def _summary(result: dict[str, Any]) -> str:
    if "error" in result:
        return "FAILED " + result["error"][-300:]
    return (
        f"decode bs1 {_decode_figure(result, 'decode_bs1')}, bs16 {_decode_figure(result, 'decode_bs16')}, "
        f"prefill {result['prefill_tok_s']} tok/s, one long prompt {result['prefill_long_tok_s']} tok/s, "
        f"weights {result['gpu_weight_gb']} GiB"
    )
