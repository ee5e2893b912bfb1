"""Helpers of the unit tests that build kt-hybrid MoE layers the way vLLM builds them
(``vllm_kt_tools.support.moe_layers``) and compare them with a dense float32 reference."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from vllm_kt_plugin.hybrid.quant_config import KTHybridConfig
from vllm_kt_plugin.settings.loader import load_settings
from vllm_kt_tools.support.moe_layers import HIDDEN, build_moe, load, random_experts, random_routing

E, K = 8, 2
# bf16 output of the native kernel plus bf16 rounding of the sum: |err| <= ~2 ulp.
ATOL_REL = 2**-7


def kt_config(**env: str) -> KTHybridConfig:
    return KTHybridConfig(settings=load_settings({k.upper(): v for k, v in env.items()}, cores=4))


def expert_numel(layer: torch.nn.Module) -> int:
    return sum(p.numel() for name, p in layer.named_parameters() if name.startswith(("w13", "w2")))


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    err = (out.float() - ref).abs().max().item()
    assert err <= ATOL_REL * ref.abs().max().item() * 2, (err, ref.abs().max().item())


def write_kt_checkpoint(directory: Path, layers: dict[int, dict]) -> None:
    """Experts of several decoder layers, named as in a Hugging Face checkpoint."""
    tensors = {
        f"model.layers.{idx}.mlp.experts.{e}.{n}.weight": t.contiguous()
        for idx, experts in layers.items()
        for e, ws in experts.items()
        for n, t in ws.items()
    }
    save_file(tensors, directory / "model.safetensors")


# The hybrid layer's output against the dense float32 reference, relative to the reference's
# largest value. Cause: bf16 rounding of the native kernel's output and of the CPU+GPU sum,
# about 2 ulp = 2**-7, as ATOL_REL. Measured on the 2-core AMX dev box (torch backend, 3 of 8
# experts on vLLM's CPU kernel; `pytest -s -k "plugs_in or compiled_op"` on the tests then in
# tests/unit/test_forward_paths.py, now tests/unit/hybrid/test_paths.py and test_moe_method.py,
# 2026-12-06): 0.0029 (5 tokens), 0.0036 (6), 0.0029 (the op, 8);
# over 150 such forwards (5, 6 and 8 tokens, seeds 0-49, a one-off loop over `forward` below) at
# most 0.0055, median 0.0035. Bound: 2**-6 = 0.0156, twice that rounding and 2.8x the largest
# measured (a path that doubles the output is compared, relatively, with a doubled reference).
REFERENCE_BOUND = 2**-6


def hybrid_layer(**env: str):
    config = KTHybridConfig(settings=load_settings({"KT_BACKEND": "torch", **env}, cores=4))
    runner = build_moe(config)
    experts = random_experts(E, seed=3)
    load(runner, experts)
    return runner.routed_experts, experts


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref).abs().max().item() / ref.abs().max().item()


def forward(layer, tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    ids, weights = random_routing(tokens, E, K, seed=seed)
    return layer.quant_method.apply(layer, x, weights, ids, None, None), x, ids, weights
