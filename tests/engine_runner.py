"""Greedy generation with a real vLLM engine, in a process of its own.

Usage: python engine_runner.py '<json>' with keys model, prompts, max_tokens and llm
(keyword arguments for vllm.LLM). KT_* settings come from the environment. Prints one
line ``RESULT <json>``: per prompt, the token ids and the top-2 logprobs of each step.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    args = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    llm = LLM(model=args["model"], max_model_len=256, seed=0, **args.get("llm", {}))
    params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"], ignore_eos=True, logprobs=2)
    results = []
    for output in llm.generate(args["prompts"], params):
        completion = output.outputs[0]
        top2 = [sorted((lp.logprob for lp in step.values()), reverse=True)[:2] for step in completion.logprobs]
        results.append({"ids": list(completion.token_ids), "top2": top2, "text": completion.text})
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
