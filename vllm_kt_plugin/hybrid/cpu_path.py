"""The CPU-experts path, every forward's default: submit the CPU experts -> run the GPU
experts -> sync and add.

On CUDA, kt-kernel orders its copies and work on the current stream, so the GPU experts
queued between submit and sync overlap the CPU work; on the CPU platform the same order
runs with a synchronous submit/sync. Where this rank computes no CPU experts (all experts
on the GPU, or a tensor-parallel rank other than 0: vLLM's all-reduce adds rank 0's), the
path is the GPU experts alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_kt_plugin.cpu_backends.base import CPUExperts
from vllm_kt_plugin.hybrid.contracts import Forward, ForwardPath, LayerParts, StageMarks
from vllm_kt_plugin.hybrid.staging.plan import CPU_PATH


class CPUExpertsPath(ForwardPath):
    name = CPU_PATH

    def __init__(self, parts: LayerParts, cpu: CPUExperts) -> None:
        self.gpu = parts.gpu
        self.cpu = cpu
        self.hidden_size = parts.moe.hidden_dim

    def takes(self, forward: Forward) -> bool:
        return True

    def run(self, forward: Forward, marks: StageMarks) -> torch.Tensor:
        x = forward.x
        # Some GPU kernels pad the hidden size; the CPU experts see the model's own.
        x_cpu = x[..., : self.hidden_size] if x.shape[-1] != self.hidden_size else x
        self.cpu.submit(x_cpu, forward.topk_ids, forward.topk_weights)
        marks.submitted()
        out = self.gpu.apply(forward.layer, x, forward.topk_weights, forward.topk_ids)
        marks.gpu_done()
        cpu_out = self.cpu.sync(x_cpu).to(x.dtype)
        if cpu_out.shape[-1] != x.shape[-1]:
            cpu_out = F.pad(cpu_out, (0, x.shape[-1] - cpu_out.shape[-1]))
        result = cpu_out.clone() if out is None else out + cpu_out
        marks.synced()
        return result


class GPUExpertsOnlyPath(ForwardPath):
    """The layer's path where this rank computes no CPU experts."""

    name = CPU_PATH

    def __init__(self, parts: LayerParts) -> None:
        self.gpu = parts.gpu

    def takes(self, forward: Forward) -> bool:
        return True

    def run(self, forward: Forward, marks: StageMarks) -> torch.Tensor:
        out = self.gpu.apply(forward.layer, forward.x, forward.topk_weights, forward.topk_ids)
        return out if out is not None else torch.zeros_like(forward.x)


def build(parts: LayerParts) -> ForwardPath:
    return CPUExpertsPath(parts, parts.cpu) if parts.cpu is not None else GPUExpertsOnlyPath(parts)
