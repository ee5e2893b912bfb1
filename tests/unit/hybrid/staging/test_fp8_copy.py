"""The block-FP8 host copy (``hybrid/staging/fp8_copy.py``): the quantizer, the loader into a
block-FP8 shadow, and the layer it computes against the dense reference."""

from __future__ import annotations

import pytest
import torch
from kt_testing.hybrid_layers import E, K, kt_config

from vllm_kt_plugin.hybrid.staging.build import staging_path
from vllm_kt_plugin.hybrid.staging.fp8_copy import quantize_block_fp8
from vllm_kt_plugin.hybrid.staging.host_experts import HostExperts
from vllm_kt_plugin.hybrid.staging.plan import FP8_BLOCK
from vllm_kt_plugin.hybrid.vllm_compat import cpu_runs_block_fp8_moe
from vllm_kt_tools.support.moe_layers import (
    HIDDEN,
    INTER,
    build_moe,
    load,
    random_experts,
    random_routing,
    reference_moe,
)

# The FP8 host copy's layer output against the dense reference, relative to its largest value
# (vLLM's CPU build runs block-FP8 MoE only on AMX CPUs; the test skips elsewhere). Measured on
# the 2-core AMX dev box (amx_bf16, avx512_fp16; then in tests/unit/test_moe_method.py, `pytest -s -k
# fp8_host_copy_matches`, 2026-12-05): 0.0310 with the whole layer and with the split. FP8 e4m3
# weights carry up to 2**-4 relative error each (half an ulp of 3 mantissa bits). Bound: 2**-4,
# twice the measurement.
FP8_COPY_LAYER_BOUND = 2**-4


def test_block_fp8_quantization_round_trips() -> None:
    """The FP8 copy's quantizer: 128 x 128 blocks, each scaled to its own largest value
    (partial blocks at the edges too); e4m3 keeps 3 mantissa bits, so each weight comes
    back within 2**-4 of its magnitude (half an ulp), plus the block's subnormal floor."""
    weight = torch.randn(200, 300, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    weight[:128, :128] *= 100  # one block far larger: its scale must not spill into others
    q, scale = quantize_block_fp8(weight)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (200, 300) and scale.shape == (2, 3)
    back = q.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    floor = 2**-9 * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    assert bool(((back - weight.float()).abs() <= weight.float().abs() * 2**-4 + floor).all())


@pytest.mark.skipif(
    not cpu_runs_block_fp8_moe(),
    reason="vLLM's CPU build runs block-FP8 MoE only on AMX CPUs (CPUExpertsFp8); the GPU sitting measures it",
)
@pytest.mark.parametrize("split", ["auto", "0.5"])
def test_fp8_host_copy_matches_dense_reference(vllm_layer_context, fresh_process_state, split: str) -> None:
    """KT_STAGING_FP8_COPY=1: the CPU experts' host copy is block FP8, quantized as the
    checkpoint loads and run by vLLM's FP8 MoE method (here its CPU build's kernel) from the
    staging buffer, whole layer or split; half the bytes of the BF16 copy. Within FP8's
    error of the dense reference (measured: see the bound). Experts 128 wide: the CPU kernel
    takes 128 x 128 blocks only (vLLM refines the blocks of narrower experts)."""
    env = dict(kt_backend="torch", kt_num_gpu_experts="2", kt_staging_min_tokens="12", kt_staging_fp8_copy="1")
    runner = build_moe(kt_config(**env, kt_staging_split=split), inter=FP8_BLOCK)
    layer = runner.routed_experts
    method = layer.quant_method
    experts = random_experts(E, seed=44, inter=FP8_BLOCK)
    load(runner, experts)
    prefill = staging_path(method.paths)
    assert prefill.host.fp8_copy and prefill.host.binds_scales
    bf16_bytes = (E - 2) * 3 * HIDDEN * FP8_BLOCK * 2
    assert prefill.host.host_nbytes < 0.6 * bf16_bytes, (prefill.host.host_nbytes, bf16_bytes)
    uses = prefill.buffers.uses
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(45)).to(torch.bfloat16)
    ids, weights = random_routing(40, E, K, seed=46)
    out = method.apply(layer, x, weights, ids, None, None)
    assert prefill.buffers.uses == uses + 1
    ref = reference_moe(x, ids, weights, experts)
    err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
    print(f"FP8 copy ({split}): max error {err:.4f} of the output's largest value")
    assert err <= FP8_COPY_LAYER_BOUND, err


def test_fp8_host_copy_loads_each_shard_into_its_blocks(vllm_layer_context) -> None:
    """The FP8 copy's loader (runs on any CPU, unlike vLLM's FP8 kernel): each checkpoint
    tensor is quantized into its expert's rows of the block-FP8 shadow — gate then up in
    w13, each half with its own block scales, down in w2 — and dequantizes to the tensor."""
    runner = build_moe(kt_config(kt_backend="torch", kt_num_gpu_experts="2"))
    layer = runner.routed_experts
    method = layer.quant_method
    cpu_ids = method.placement.cpu_expert_ids()
    args = dict(hidden_size=HIDDEN, intermediate_size_per_partition=INTER, params_dtype=torch.bfloat16)
    host = HostExperts(layer, method.parts.make_shadow_native, cpu_ids, args, pin=False, fp8_copy=True)
    assert host.binds_scales and set(host.layout) >= {"w13_weight", "w13_weight_scale_inv", "w2_weight"}
    experts = random_experts(E, seed=47)
    shards = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    for slot, expert in enumerate(cpu_ids):
        for name, shard in shards.items():
            param = "w2_weight" if shard == "w2" else "w13_weight"
            host.load(param, experts[expert][name], f"{expert}.{name}.weight", shard, slot)
    shadow = host.shadow

    def dequantized(name: str, slot: int) -> torch.Tensor:
        q, scale = getattr(shadow, name).data[slot].float(), getattr(shadow, f"{name}_scale_inv").data[slot]
        halves = 2 if name == "w13_weight" else 1  # gate and up: blocks of their own (INTER < 128 here)
        parts = []
        for q_part, s_part in zip(q.chunk(halves), scale.chunk(halves), strict=True):
            full = s_part.repeat_interleave(128, 0).repeat_interleave(128, 1)[: q_part.shape[0], : q_part.shape[1]]
            parts.append(q_part * full)
        return torch.cat(parts)

    for slot, expert in enumerate(cpu_ids):
        w13 = torch.cat([experts[expert]["gate_proj"], experts[expert]["up_proj"]]).float()
        for name, want in (("w13_weight", w13), ("w2_weight", experts[expert]["down_proj"].float())):
            got = dequantized(name, slot)
            assert bool(((got - want).abs() <= want.abs() * 2**-4 + 2**-9 * want.abs().max()).all()), (name, slot)
