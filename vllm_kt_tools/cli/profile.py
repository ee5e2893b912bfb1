"""``vllm-kt profile``: serve a prompt file through kt-hybrid and record, per MoE layer,
how often each expert is picked, as a routing profile for KT_EXPERT_PLACEMENT=frequency.

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and eagerly, so the
counts are read straight from the layers after generation; no worker has to write files.
The profile also records the CPU expert evaluations the run made under its placement, so
two runs (uniform, then frequency) show what a placement saves.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from vllm_kt_plugin.settings.catalogue import SETTINGS_PREFIX


def read_prompts(path: str | Path) -> list[str]:
    """Text lines, or JSONL objects with "prompt" / "text" (a chat prompt: "messages",
    rendered with the model's chat template by vLLM)."""
    prompts: list[Any] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        if not line.lstrip().startswith("{"):
            prompts.append(line)
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        text = item.get("prompt", item.get("text"))
        if text is None and "messages" not in item:
            raise SystemExit(f"{path}:{number}: a JSON line needs 'prompt', 'text' or 'messages'")
        prompts.append(text if text is not None else {"messages": item["messages"]})
    if not prompts:
        raise SystemExit(f"{path}: no prompts")
    return prompts


def profile(model: str, prompts: list[Any], max_tokens: int, llm_args: dict[str, Any]) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams  # deferred: after VLLM_ENABLE_V1_MULTIPROCESSING is set

    from vllm_kt_plugin.hybrid.process_state import process_state  # the engine runs in this process

    llm = LLM(model=model, quantization="kt-hybrid", enforce_eager=True, seed=0, **llm_args)
    recorder = process_state().recorder
    recorder.reset()  # vLLM's start-up forwards (memory profiling, warm-up) are not the workload
    recorder.enabled = True
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    texts = [p for p in prompts if isinstance(p, str)]
    chats = [p["messages"] for p in prompts if not isinstance(p, str)]
    if texts:
        llm.generate(texts, params, use_tqdm=False)
    if chats:
        llm.chat(chats, params, use_tqdm=False)
    recorder.enabled = False
    num_experts = next(iter(recorder.counts.values())).numel() if recorder.counts else 0
    return {
        "model": model,
        "num_experts": num_experts,
        "layers": {str(i): c.tolist() for i, c in sorted(recorder.counts.items())},
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "cpu_evaluations": sum(recorder.cpu_evaluations.values()),
        "gpu_expert_ids": {str(i): e for i, e in sorted(recorder.gpu_expert_ids.items())},
        "settings": {k: v for k, v in os.environ.items() if k.startswith(SETTINGS_PREFIX)},
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model")
    parser.add_argument("--prompts", required=True, help="text file (one prompt per line) or JSONL")
    parser.add_argument("--out", required=True, help="routing profile JSON to write (KT_EXPERT_PROFILE)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--max-model-len", type=int, default=2048)


def run(args: argparse.Namespace) -> int:
    prompts = read_prompts(args.prompts)
    print(f"[profile] {len(prompts)} prompts from {args.prompts}; starting vLLM (eager, in-process)", flush=True)
    result = profile(args.model, prompts, args.max_tokens, {"max_model_len": args.max_model_len})
    Path(args.out).write_text(json.dumps(result) + "\n")
    print(
        f"[profile] wrote {args.out}: {len(result['layers'])} MoE layers, {result['cpu_evaluations']} CPU expert "
        "evaluations under the current placement",
        flush=True,
    )
    return 0
