"""A third-party CPU backend for the tests, installed through the entry-point group
``vllm_kt_plugin.cpu_backends``: it returns zeros, i.e. drops every CPU expert. The
end-to-end tests use it to show that losing the CPU experts changes the tokens."""

from __future__ import annotations

import torch

from vllm_kt_plugin.cpu_backends.base import CheckpointFormat, CPUExperts
from vllm_kt_plugin.hookspecs import hookimpl
from vllm_kt_plugin.settings.variables import KTSettings


class ZeroExperts(CPUExperts):
    name = "zeros"

    @classmethod
    def default_method(cls, checkpoint: CheckpointFormat) -> str:
        return "BF16"

    @classmethod
    def validate(cls, settings: KTSettings, checkpoint: CheckpointFormat) -> None:
        pass

    def finalize_weights(self, max_deferred_experts_per_token: int) -> None:
        pass

    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        pass

    def sync(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)


@hookimpl
def kt_cpu_backends():
    return {ZeroExperts.name: ZeroExperts}
