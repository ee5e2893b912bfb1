"""A layer's GPU experts (``hybrid/gpu_experts.py``): what staging reads of the native kernel
vLLM chose, once per layer (``native_kernel``), on real vLLM MoE layers."""

from __future__ import annotations

from vllm_kt_plugin.hybrid.gpu_experts import native_kernel
from vllm_kt_plugin.settings.catalogue import BLOCK_FP8, UNQUANTIZED
from vllm_kt_tools.support.moe_layers import build_moe


def test_the_native_kernel_as_staging_names_it(vllm_layer_context) -> None:
    """Unquantized experts on vLLM's CPU kernel: read from the layer (stageable), not the
    Triton layout kt-kernel writes; block-FP8 experts: BLOCK_FP8, quantized."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    plain = native_kernel(build_moe(None).routed_experts.quant_method)
    assert (plain.experts, plain.reads_layer, plain.block_fp8, plain.raw_layout) == (UNQUANTIZED, True, False, False)
    assert "UnquantizedFusedMoEMethod" in plain.name
    block = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    fp8 = native_kernel(build_moe(Fp8Config.from_config(block), hidden=256, inter=256).routed_experts.quant_method)
    assert (fp8.experts, fp8.reads_layer, fp8.block_fp8) == (BLOCK_FP8, False, True)
