"""Quantized checkpoints end to end on a CUDA GPU: with ``--quantization kt-hybrid`` and
KT_METHOD left to its default, the GPU experts run on the checkpoint's own vLLM method and
kt-kernel reads the same files (FP8, RAWINT4, GPTQ_INT4); greedy tokens against plain vLLM
on the same checkpoint, with half the experts on the CPU and with all of them.

kt-kernel's CPU arithmetic is not the GPU kernels' (vLLM's block-FP8 MoE also quantizes
activations to FP8; Marlin accumulates differently), so the comparison allows what
QUANTIZED_BOUNDS states: completions that may differ (of the six) and the largest
chosen-token logprob drift while the tokens agree. Eager mode keeps the 12 engine starts
within a sitting; CUDA graphs around the CPU experts are test_gpu.py's.

Skipped without a GPU; run with ``python -m pytest -m gpu tests/engine/test_quantized_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from kt_testing.engines import PROMPTS, generate, generate_logged, long_prompt, top1_drift

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.engine,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (arch, format, vLLM's MoE method on the GPU side, kt-kernel's method on the CPU side)
CHECKPOINTS = [
    ("qwen3_moe", "fp8-block", "Fp8MoEMethod", "FP8"),
    ("deepseek_v3", "fp8-block", "Fp8MoEMethod", "FP8"),
    ("deepseek_v3", "ct-int4", "CompressedTensorsWNA16MoEMethod", "RAWINT4"),
    ("qwen3_moe", "gptq-int4", "AutoGPTQMoEMethod", "GPTQ_INT4"),
]
PLACEMENTS = {"half on CPU": "4", "all on CPU": "0"}
# format: (completions that may differ, chosen-token logprob drift). Measured on the H200:
# Qwen3-MoE block-FP8 0 differ / 0.0001 (half on CPU), 0.0002 (all); GPTQ 0 / 0.0000 (half);
# DeepSeek-V3 block-FP8 0 / 0.108 (half: vLLM's FP8 MoE also quantizes the activations, per
# 128-wide group, kt-kernel's FP8 keeps them BF16; on a checkpoint whose kv_a_proj_with_mqa
# the writer had left out, since fixed; on the rewritten one: 1 of 6 differ, 0.040).
# DeepSeek-V3 compressed-tensors INT4: 0 / 0.043 (half). All on CPU (2026-12-04): DeepSeek-V3
# block-FP8 1 / 0.040, compressed-tensors INT4 0 / 0.043, GPTQ Qwen3-MoE 0 / 0.0001. With GPU
# prefill (block-FP8, half): Qwen3-MoE 0 / 0.0001, DeepSeek-V3 1 / 0.040. FP8's bound leaves
# room above 0.108.
QUANTIZED_BOUNDS = {"fp8-block": (1, 0.15), "ct-int4": (1, 0.1), "gptq-int4": (1, 0.1)}
LLM = {"enforce_eager": True, "max_num_batched_tokens": 64}
_plain: dict[str, list] = {}


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_block_fp8_gpu_prefill_against_plain_vllm(quantized_model, arch: str) -> None:
    """KT_GPU_PREFILL_MIN_TOKENS=32 on a block-FP8 checkpoint, half the experts on the CPU:
    forwards of 32 to 64 tokens (every prefill chunk here) compute the CPU experts on the
    GPU with vLLM's Triton FP8 kernel, from kt-kernel's FP8 experts written back into pinned
    buffers (no host copy); decode stays on kt-kernel. Greedy tokens against plain vLLM
    within the FP8 bound."""
    model = quantized_model(arch, "fp8-block")
    prompts = PROMPTS + [long_prompt(model, 180)]
    if str(model) not in _plain:
        _plain[str(model)] = generate(model, prompts, kt=None, llm=LLM, VLLM_PLUGINS="")
    kt = {"KT_NUM_GPU_EXPERTS": "4", "KT_GPU_PREFILL_MIN_TOKENS": "32"}
    got, log = generate_logged(model, prompts, kt=kt, llm=LLM)
    assert "kt-hybrid: GPU prefill ran" in log and "FP8 CPU experts written by kt_kernel (no host copy)" in log
    differing = sum(g["ids"] != w["ids"] for g, w in zip(got, _plain[str(model)], strict=True))
    worst = top1_drift(got[: len(PROMPTS)], _plain[str(model)][: len(PROMPTS)])
    print(f"{arch} fp8-block GPU prefill: {differing} of {len(got)} completions differ; drift {worst:.4f}")
    max_differing, max_drift = QUANTIZED_BOUNDS["fp8-block"]
    assert differing <= max_differing and worst <= max_drift, (differing, worst)


@pytest.mark.parametrize("placement", list(PLACEMENTS), ids=list(PLACEMENTS))
@pytest.mark.parametrize(("arch", "fmt", "native", "method"), CHECKPOINTS, ids=[f"{c[0]}-{c[1]}" for c in CHECKPOINTS])
def test_quantized_checkpoint_against_plain_vllm(
    quantized_model, arch: str, fmt: str, native: str, method: str, placement: str
) -> None:
    model = quantized_model(arch, fmt)
    prompts = PROMPTS + [long_prompt(model, 180)]
    if str(model) not in _plain:
        _plain[str(model)] = generate(model, prompts, kt=None, llm=LLM, VLLM_PLUGINS="")
    expected = _plain[str(model)]
    got, log = generate_logged(model, prompts, kt={"KT_NUM_GPU_EXPERTS": PLACEMENTS[placement]}, llm=LLM)
    assert f"GPU side: {native}, CPU side: kt_kernel {method} " in log
    differing = sum(g["ids"] != w["ids"] for g, w in zip(got, expected, strict=True))
    worst = top1_drift(got[: len(PROMPTS)], expected[: len(PROMPTS)])
    print(f"{arch} {fmt} {placement}: {differing} of {len(got)} completions differ; drift {worst:.4f}")
    max_differing, max_drift = QUANTIZED_BOUNDS[fmt]
    assert differing <= max_differing and worst <= max_drift, (differing, worst)
