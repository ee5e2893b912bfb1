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
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


class RoutingRecorder:
    """Counts of ``topk_ids`` per layer, and picks that went to the CPU, while enabled."""

    def __init__(self) -> None:
        self.enabled = False
        self.reset()

    def reset(self) -> None:
        self.counts: dict[int, torch.Tensor] = {}
        self.cpu_evaluations: dict[int, int] = {}
        self.gpu_experts: dict[int, list[int]] = {}

    def record(self, layer_idx: int, topk_ids: torch.Tensor, gpu_mask: torch.Tensor) -> None:
        ids = topk_ids.reshape(-1).long().cpu()
        picks = torch.bincount(ids, minlength=gpu_mask.numel())
        self.counts[layer_idx] = self.counts.get(layer_idx, torch.zeros_like(picks)) + picks
        self.cpu_evaluations[layer_idx] = self.cpu_evaluations.get(layer_idx, 0) + int(picks[~gpu_mask].sum())
        if layer_idx not in self.gpu_experts:  # a layer's placement is fixed
            self.gpu_experts[layer_idx] = torch.nonzero(gpu_mask).flatten().tolist()


RECORDER = RoutingRecorder()


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
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, quantization="kt-hybrid", enforce_eager=True, seed=0, **llm_args)
    RECORDER.reset()  # vLLM's start-up forwards (memory profiling, warm-up) are not the workload
    RECORDER.enabled = True
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    texts = [p for p in prompts if isinstance(p, str)]
    chats = [p["messages"] for p in prompts if not isinstance(p, str)]
    if texts:
        llm.generate(texts, params, use_tqdm=False)
    if chats:
        llm.chat(chats, params, use_tqdm=False)
    RECORDER.enabled = False
    num_experts = next(iter(RECORDER.counts.values())).numel() if RECORDER.counts else 0
    return {
        "model": model,
        "num_experts": num_experts,
        "layers": {str(i): c.tolist() for i, c in sorted(RECORDER.counts.items())},
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "cpu_evaluations": sum(RECORDER.cpu_evaluations.values()),
        "gpu_experts": {str(i): e for i, e in sorted(RECORDER.gpu_experts.items())},
        "settings": {k: v for k, v in os.environ.items() if k.startswith("KT_")},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-kt profile", description="record per-layer expert activation counts (KT_* settings from the env)"
    )
    parser.add_argument("model")
    parser.add_argument("--prompts", required=True, help="text file (one prompt per line) or JSONL")
    parser.add_argument("--out", required=True, help="routing profile JSON to write (KT_EXPERT_PROFILE)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
