"""The CPU-experts path (``hybrid/cpu_path.py``) on real vLLM MoE layers (torch backend): the
default path of every forward, and the GPU experts alone where this rank computes no CPU
experts."""

from __future__ import annotations

import torch
from kt_testing.hybrid_layers import REFERENCE_BOUND, E, K, hybrid_layer, relative_error

from vllm_kt_plugin.hybrid.contracts import Forward
from vllm_kt_plugin.hybrid.cpu_path import CPUExpertsPath, GPUExpertsOnlyPath
from vllm_kt_plugin.hybrid.staging.plan import CPU_PATH
from vllm_kt_tools.support.moe_layers import HIDDEN, random_routing, reference_moe


class Marks:
    """StageMarks that record the order the path marks its stages in."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def submitted(self) -> None:
        self.seen.append("submitted")

    def gpu_done(self) -> None:
        self.seen.append("gpu_done")

    def planned(self, staged: int, picked: int, way: str) -> None:
        self.seen.append("planned")

    def synced(self) -> None:
        self.seen.append("synced")


def _forward(layer, tokens: int, seed: int) -> Forward:
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    ids, weights = random_routing(tokens, E, K, seed=seed)
    return Forward(layer, x, weights, ids, False)


def test_the_cpu_path_submits_runs_the_gpu_experts_then_syncs(vllm_layer_context, fresh_process_state) -> None:
    """Submit the CPU experts, then the GPU experts (queued while the CPU works), then sync
    and add: the marks come in that order and the sum is the dense reference's."""
    layer, experts = hybrid_layer(KT_NUM_GPU_EXPERTS="3")
    [path] = layer.quant_method.paths
    assert isinstance(path, CPUExpertsPath) and path.name == CPU_PATH
    forward = _forward(layer, 6, seed=21)
    marks = Marks()
    out = path.run(forward, marks)
    assert marks.seen == ["submitted", "gpu_done", "synced"]
    error = relative_error(out, reference_moe(forward.x, forward.topk_ids, forward.topk_weights, experts))
    assert error <= REFERENCE_BOUND, error


def test_a_layer_without_cpu_experts_runs_its_gpu_experts_alone(vllm_layer_context, fresh_process_state) -> None:
    """Every expert on the GPU: no CPU backend, so the path is the GPU experts alone (it
    marks nothing: there is no CPU side to time) and still the dense reference's output."""
    layer, experts = hybrid_layer(KT_NUM_GPU_EXPERTS=str(E))
    assert layer.quant_method.cpu is None
    [path] = layer.quant_method.paths
    assert isinstance(path, GPUExpertsOnlyPath) and path.name == CPU_PATH
    forward = _forward(layer, 5, seed=22)
    marks = Marks()
    out = path.run(forward, marks)
    assert marks.seen == []
    error = relative_error(out, reference_moe(forward.x, forward.topk_ids, forward.topk_weights, experts))
    assert error <= REFERENCE_BOUND, error
