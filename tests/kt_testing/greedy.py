"""Greedy completions from a fresh vLLM engine, with the top-2 tokens and logprobs of every step:
what the end-to-end tests compare between kt-hybrid and plain vLLM. Runs in a child
process (``vllm_kt_tools.support.child``); KT_* settings come from its environment."""

from __future__ import annotations

from typing import Any

from vllm_kt_tools.support.engine_lock import engine_lock, stop_engine


def greedy_completions(model: str, prompts: list[str], max_tokens: int, llm: dict[str, Any]) -> list[dict[str, Any]]:
    from vllm import LLM, SamplingParams  # deferred: runs in the child process only

    with engine_lock():
        engine = LLM(model=model, max_model_len=256, seed=0, **llm)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    results = []
    for output in engine.generate(prompts, params):
        completion = output.outputs[0]
        steps = [sorted(step.items(), key=lambda item: -item[1].logprob)[:2] for step in completion.logprobs]
        top2 = [[lp.logprob for _, lp in step] for step in steps]
        top2_ids = [[token for token, _ in step] for step in steps]
        results.append({"ids": list(completion.token_ids), "top2": top2, "top2_ids": top2_ids, "text": completion.text})
    stop_engine(engine)
    return results
