"""The block-FP8 host copy (KT_STAGING_FP8_COPY): unquantized CPU experts quantized as the
checkpoint loads, into a shadow that vLLM's own block-FP8 MoE method runs.

Blocks of 128 x 128 with float32 scales (kt-kernel's FP8 and DeepSeek-V3's format; gate
and up each in their own blocks): half the RAM and half the PCIe bytes of the BF16 copy,
at the accuracy docs/split.md states.
"""

from __future__ import annotations

import torch

from vllm_kt_plugin.cpu_backends.base import DUMMY_HIGH
from vllm_kt_plugin.hybrid.staging.plan import FP8_BLOCK
from vllm_kt_plugin.hybrid.vllm_compat import DOWN_SHARD, GATE_SHARD, UP_SHARD

FP8_MAX = 448  # float8_e4m3fn's largest magnitude


def quantize_block_fp8(weight: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """A [rows, cols] matrix as float8_e4m3fn and float32 scales per ``block`` x ``block``
    (vLLM's ``weight_scale_inv``: weight ~ fp8 * scale), each block scaled to its largest
    magnitude. Partial blocks at the edges are scaled by their own part."""
    rows, cols = weight.shape
    brows, bcols = -(-rows // block), -(-cols // block)
    padded = torch.zeros(brows * block, bcols * block, dtype=torch.float32)
    padded[:rows, :cols] = weight.to(torch.float32)
    blocks = padded.view(brows, block, bcols, block)
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    scale = (blocks.abs().amax(dim=(1, 3)) / fp8_max).clamp_min(torch.finfo(torch.float32).tiny)
    scaled = (blocks / scale[:, None, :, None]).clamp(-fp8_max, fp8_max).view(brows * block, bcols * block)
    return scaled[:rows, :cols].to(torch.float8_e4m3fn), scale


def load_fp8(shadow: torch.nn.Module, weight: torch.Tensor, shard_id: str, slot: int) -> None:
    """A gate (w1), up (w3) or down (w2) matrix of one expert, whole (one tensor-parallel
    rank), quantized into the shadow's rows of CPU expert ``slot``: w13 holds gate then up,
    each in blocks of its own."""
    q, scale = quantize_block_fp8(weight)
    target = "w2" if shard_id == DOWN_SHARD else "w13"
    rows = getattr(shadow, f"{target}_weight").data[slot]
    scales = getattr(shadow, f"{target}_weight_scale_inv").data[slot]
    half = {GATE_SHARD: 0, UP_SHARD: 1}.get(shard_id, 0)
    n, b = q.shape[0], scale.shape[0]
    if rows.shape[-1] != q.shape[1] or rows.shape[0] not in (n, 2 * n):
        raise ValueError(f"kt-hybrid FP8 copy: {shard_id} of shape {tuple(weight.shape)} does not fit {rows.shape}")
    rows[half * n : (half + 1) * n].copy_(q)
    scales[half * b : (half + 1) * b].copy_(scale)


def fill_dummy_fp8(shadow: torch.nn.Module) -> None:
    """load_format=dummy: random FP8 weights with scales that put them in vLLM's dummy
    range (values do not change the kernels' speed)."""
    for name, param in shadow.named_parameters(recurse=False):
        if name.endswith("_scale_inv"):
            param.data.fill_(DUMMY_HIGH / FP8_MAX)
        elif param.dtype == torch.float8_e4m3fn:
            base = torch.empty(param.shape[1:], dtype=torch.float32).uniform_(-FP8_MAX, FP8_MAX)
            param.data[0::2] = base.to(param.dtype)
            param.data[1::2] = (-base).to(param.dtype)
