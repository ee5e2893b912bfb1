"""kt-hybrid around a checkpoint's own quantization: linear layers and everything but the
routed experts get the checkpoint's method untouched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_kt_plugin.hybrid.moe_method import KTHybridMoEMethod
from vllm_kt_plugin.hybrid.quant_config import QUANT_NAME, KTHybridConfig, resolve_native_method_name
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_tools.support.moe_layers import build_moe

FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic"}


def test_fp8_checkpoint_linear_and_moe_methods(
    vllm_layer_context, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from safetensors.torch import save_file
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    # fp8 GPU experts from the checkpoint; BF16 CPU experts from a directory of their own
    # (kt-kernel reads no per-tensor fp8 checkpoint, so KT_METHOD must be given).
    expert = torch.zeros(64, 256, dtype=torch.bfloat16)  # the BF16 tensors kt-kernel's BF16 reads
    save_file({"model.layers.0.mlp.experts.0.gate_proj.weight": expert}, str(tmp_path / "experts.safetensors"))
    monkeypatch.setenv("KT_NUM_GPU_EXPERTS", "2")
    monkeypatch.setenv("KT_METHOD", "BF16")
    monkeypatch.setenv("KT_WEIGHT_PATH", str(tmp_path))
    config = KTHybridConfig.from_config(dict(FP8))
    assert isinstance(config.native, Fp8Config)
    assert (config.checkpoint.quant_method, config.settings.method, config.settings.num_gpu_experts) == (
        "fp8",
        "BF16",
        2,
    )

    reference = Fp8Config.from_config(dict(FP8))
    linear = ReplicatedLinear(256, 256, bias=False, quant_config=config, prefix="model.layers.0.mlp.gate_up")
    expected_linear = ReplicatedLinear(256, 256, bias=False, quant_config=reference, prefix="model.layers.0.mlp.down")
    assert type(linear.quant_method) is type(expected_linear.quant_method)
    assert "Fp8" in type(linear.quant_method).__name__

    moe = build_moe(config, hidden=256, inter=256).routed_experts
    expected_moe = build_moe(reference, hidden=256, inter=256).routed_experts
    assert isinstance(moe.quant_method, KTHybridMoEMethod)
    assert type(moe.quant_method.native) is type(expected_moe.quant_method)
    assert "Fp8" in type(moe.quant_method.native).__name__
    # The native fp8 method allocated its weights and scales for the 2 GPU experts only.
    assert moe.w13_weight.shape[0] == 2 and moe.w13_weight.dtype == torch.float8_e4m3fn
    assert expected_moe.w13_weight.shape[0] == 8
    assert moe.w13_weight_scale.shape[0] == 2 and expected_moe.w13_weight_scale.shape[0] == 8


def test_fp8_checkpoint_without_kt_method_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KT_METHOD", raising=False)
    with pytest.raises(KTConfigError, match="KT_METHOD is unset"):
        KTHybridConfig.from_config(dict(FP8))


def test_vllm_picks_the_native_method_as_without_the_plugin() -> None:
    assert resolve_native_method_name(dict(FP8)) == "fp8"
    assert resolve_native_method_name({"quant_method": "compressed-tensors", "config_groups": {}}) == (
        "compressed-tensors"
    )


def test_quantized_checkpoint_with_kt_hybrid_is_not_a_mismatch() -> None:
    assert KTHybridConfig.override_quantization_method(dict(FP8), QUANT_NAME) == QUANT_NAME
    assert KTHybridConfig.override_quantization_method(dict(FP8), None) is None
    assert KTHybridConfig.override_quantization_method(dict(FP8), "fp8") is None


def test_unquantized_checkpoint(vllm_layer_context) -> None:
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.linear import ReplicatedLinear, UnquantizedLinearMethod

    config = KTHybridConfig()
    assert config.native is None and config.get_name() == QUANT_NAME
    linear = ReplicatedLinear(128, 128, bias=False, quant_config=config, prefix="model.layers.0.self_attn.o_proj")
    assert isinstance(linear.quant_method, UnquantizedLinearMethod)
    moe = build_moe(config).routed_experts
    assert isinstance(moe.quant_method.native, UnquantizedFusedMoEMethod)
    assert torch.bfloat16 in config.get_supported_act_dtypes()
