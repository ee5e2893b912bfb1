"""The GGUF files the engine tests serve (``vllm_kt_tools.support.gguf_export``) hold the
checkpoint's experts in llama.cpp's layout, and kt-kernel's LLAMAFILE computes from them what
the Hugging Face experts compute; with the experts stored in reverse order it does not (the
engine tests' negative control, here at the layer)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from vllm_kt_tools.support.gguf_export import export_gguf

pytest.importorskip("kt_kernel")

LAYER = 1
# Measured 2026-12-06 on the AMX box (kt-kernel amx kernels), tiny Qwen3-MoE (hidden and
# expert width 256), 16 tokens, `pytest -s tests/unit/test_gguf_export.py`: Q8_0 0.0097, Q4_0
# 0.085 relative error against the BF16 experts (Q8_0: llamafile's 8-bit activations; Q4_0:
# the weights' own 4-bit rounding); permuted 1.20. Bounds: twice the measured.
BOUNDS = {"Q8_0": 0.02, "Q4_0": 0.17}


@pytest.fixture(scope="module")
def model(tiny_model) -> Path:
    return tiny_model("qwen3_moe", gguf_experts=True)


def hf_experts(model: Path) -> dict[str, torch.Tensor]:
    return load_file(next(model.glob("*.safetensors")))


def layer_output(gguf: Path, model: Path, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    import json

    from vllm_kt_plugin.cpu_backends.kt_kernel.compat import prepare_kt_kernel
    from vllm_kt_plugin.settings.model_memory import expert_shape

    shape = expert_shape(json.loads((model / "config.json").read_text()))
    kt_kernel = prepare_kt_kernel()
    # kt-kernel keeps one input/output buffer per batch size per process, whatever the hidden
    # size (a process serves one model): other tests here ran other hidden sizes
    buffers = kt_kernel.experts_base.KExpertsCPUBuffer
    buffers.temp_bs, buffers.capture_buffers = 0, {}
    wrapper = kt_kernel.KTMoEWrapper(
        layer_idx=LAYER,
        num_experts=shape.num_experts,
        num_experts_per_tok=ids.shape[1],
        hidden_size=shape.hidden_size,
        moe_intermediate_size=shape.intermediate_size,
        gpu_experts_mask=torch.zeros(shape.num_experts, dtype=torch.bool),
        cpuinfer_threads=1,
        threadpool_count=1,
        weight_path=str(gguf),
        chunked_prefill_size=16,
        method="LLAMAFILE",
    )
    mapping = torch.arange(shape.num_experts)
    wrapper.load_weights(mapping)
    wrapper.submit_forward(x, ids, weights, 0)
    return wrapper.sync_forward(x, 0).float().clone()


def reference(model: Path, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    tensors = hf_experts(model)
    out = torch.zeros(x.shape[0], x.shape[1])
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            base = f"model.layers.{LAYER}.mlp.experts.{int(ids[t, k])}"
            gate, up, down = (tensors[f"{base}.{p}_proj.weight"].float() for p in ("gate", "up", "down"))
            xt = x[t].float()
            out[t] += weights[t, k] * (down @ (torch.nn.functional.silu(gate @ xt) * (up @ xt)))
    return out


def test_the_gguf_holds_the_experts_in_llama_cpp_layout(model: Path, tmp_path: Path) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensors = hf_experts(model)
    for permute in (False, True):
        (path,) = export_gguf(model, tmp_path / f"m-{permute}.gguf", "Q8_0", permute_experts=permute)
        found = {t.name: t for t in GGUFReader(path).tensors}
        down = found[f"blk.{LAYER}.ffn_down_exps.weight"]
        stacked = dequantize(down.data, down.tensor_type).reshape(len(down.data), -1, int(down.shape[0]))
        experts = stacked.shape[0]
        for position in range(experts):
            expert = experts - 1 - position if permute else position
            want = tensors[f"model.layers.{LAYER}.mlp.experts.{expert}.down_proj.weight"].float().numpy()
            assert np.abs(stacked[position] - want).max() <= np.abs(want).max() / 100  # Q8_0 rounding
        assert "token_embd.weight" in found and "blk.0.attn_q.weight" in found  # a whole model's file


@pytest.mark.parametrize("type_name", sorted(BOUNDS))
def test_kt_kernel_computes_the_checkpoints_experts_from_the_gguf(model: Path, tmp_path: Path, type_name: str) -> None:
    torch.manual_seed(0)
    x = (torch.randn(16, 256) * 0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(16)])
    weights = torch.rand(16, 2)
    want = reference(model, x, ids, weights)
    (path,) = export_gguf(model, tmp_path / "m.gguf", type_name)
    error = ((layer_output(path, model, x, ids, weights) - want).norm() / want.norm()).item()
    print(f"{type_name}: relative error {error:.4f}")
    assert error < BOUNDS[type_name]
    (permuted,) = export_gguf(model, tmp_path / "p.gguf", type_name, permute_experts=True)
    wrong = ((layer_output(permuted, model, x, ids, weights) - want).norm() / want.norm()).item()
    print(f"{type_name} permuted: relative error {wrong:.4f}")
    assert wrong > 0.5
