"""Offline inference with kt-hybrid: vLLM's ``LLM`` class on a tiny generated MoE model.

    .venv/bin/python examples/offline_llm.py [MODEL_DIR]

Without MODEL_DIR it trains the tiny Qwen3-MoE model into ~/.cache/vllm-kt-plugin first.
The same settings work for any MoE checkpoint: pass ``quantization="kt-hybrid"`` and set
the KT_* variables before the engine starts.
"""

import os
import sys

from vllm_kt_plugin.settings.catalogue import cache_root
from vllm_kt_tools.support.tiny_models import chat_prompt, tiny_model_dir

if __name__ == "__main__":  # vLLM starts worker processes: keep the guard
    model = sys.argv[1] if len(sys.argv) > 1 else str(tiny_model_dir("qwen3_moe", cache_root()))
    os.environ.setdefault("KT_NUM_GPU_EXPERTS", "4")  # of 8 per layer; the rest on kt-kernel
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # only read by vLLM's CPU build

    from vllm import LLM, SamplingParams

    llm = LLM(model=model, quantization="kt-hybrid", max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    prompts = ["Once upon a time", chat_prompt("What is the capital of France?")]
    for output in llm.generate(prompts, params):
        print(f"{output.prompt!r} -> {output.outputs[0].text!r}")
