"""Greedy completions from a fresh vLLM engine, with the top-2 tokens and logprobs of every step:
what the end-to-end tests compare between kt-hybrid and plain vLLM. Runs in a child
process (``vllm_kt_tools.support.child``); KT_* settings come from its environment.

After generating, the same engine scores a reference continuation of every prompt (teacher
forcing: prompt + reference tokens as one prompt, vLLM's prompt logprobs): the reference's
own tokens for plain vLLM, plain vLLM's tokens for kt-hybrid. Where the two engines' greedy
tokens part (at a tie of the reference's own), the comparison goes on with these logprobs,
and no second engine start is needed for it."""

from __future__ import annotations

from typing import Any

from vllm_kt_tools.support.engine_lock import engine_lock, stop_engine


def greedy_completions(
    model: str, prompts: list[str], max_tokens: int, llm: dict[str, Any], reference: list[list[int]] | None = None
) -> list[dict[str, Any]]:
    """``reference``: per prompt, the continuation to score (default: this engine's own)."""
    from vllm import LLM, SamplingParams  # deferred: runs in the child process only
    from vllm.inputs import TokensPrompt

    with engine_lock():
        engine = LLM(model=model, max_model_len=256, seed=0, **llm)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    results = []
    prompt_ids = []
    for output in engine.generate(prompts, params):
        completion = output.outputs[0]
        steps = [sorted(step.items(), key=lambda item: -item[1].logprob)[:2] for step in completion.logprobs]
        top2 = [[lp.logprob for _, lp in step] for step in steps]
        top2_ids = [[token for token, _ in step] for step in steps]
        results.append({"ids": list(completion.token_ids), "top2": top2, "top2_ids": top2_ids, "text": completion.text})
        prompt_ids.append(list(output.prompt_token_ids))

    continuations = reference if reference is not None else [r["ids"] for r in results]
    forced = [TokensPrompt(prompt_token_ids=p + c) for p, c in zip(prompt_ids, continuations, strict=True)]
    scoring = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    for result, start, continuation, output in zip(
        results, map(len, prompt_ids), continuations, engine.generate(forced, scoring), strict=True
    ):
        scored = output.prompt_logprobs[start:]
        result["forced_ids"] = list(continuation)
        result["forced"] = [step[token].logprob for step, token in zip(scored, continuation, strict=True)]
    stop_engine(engine)
    return results
