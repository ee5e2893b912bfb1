"""kt-kernel 0.7.2 workarounds, kept in this one place.

1. ``BaseMoEWrapper.__init__`` and ``KExpertsCPUBuffer.get_buffer`` always allocate with
   ``pin_memory=True``. Pinning needs an accelerator; on a CPU-only torch build (vLLM's
   CPU engine, CI) it raises ``RuntimeError``. We hand ``kt_kernel.experts_base`` a torch
   namespace whose tensor factories drop ``pin_memory`` when no accelerator exists.
2. Without ``KT_FORCE_SYNC_SUBMIT=1`` kt-kernel enqueues its CPU work through CUDA host
   callbacks (``submit_with_cuda_stream``), which do not exist without a GPU. That
   variable is kt-kernel's own switch to the synchronous submit/sync path.

Both apply only when torch sees no accelerator.

3. ``BaseMoEWrapper.select_deferred_experts`` (``KT_MAX_DEFERRED_EXPERTS_PER_TOKEN``)
   scatters and gathers with the routed expert ids. vLLM 0.32 marks the picks of padded
   tokens -1 (``VLLM_MOE_SKIP_PADDING``, on by default), which it pads every CUDA-graph
   batch with: on the GPU the scatter hits a device-side "index out of bounds" assert
   while vLLM captures its graphs. kt-kernel's forward itself skips -1 ids, so padded
   picks are kept out of the selection and stay -1 in both halves. Applies everywhere.
"""

from __future__ import annotations

import functools
import os
import types
from typing import Any

import torch

from vllm_kt_plugin.settings.errors import KTConfigError

_PINNING_FACTORIES = ("zeros", "empty", "full", "ones")


def _without_pinning(factory: Any) -> Any:
    @functools.wraps(factory)
    def call(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return call


def _torch_without_pinning() -> types.ModuleType:
    proxy = types.ModuleType("torch", "torch, with pin_memory ignored (no accelerator)")
    proxy.__getattr__ = lambda name: getattr(torch, name)  # type: ignore[method-assign]
    for name in _PINNING_FACTORIES:
        setattr(proxy, name, _without_pinning(getattr(torch, name)))
    return proxy


@functools.cache
def prepare_kt_kernel() -> types.ModuleType:
    """Import kt_kernel (once per process) and apply the CPU-only workarounds."""
    try:
        import kt_kernel
        import kt_kernel.experts_base as experts_base
    except ImportError as e:
        raise KTConfigError(
            "KT_BACKEND",
            "kt_kernel",
            f"kt-kernel is not importable: {e}; install it with `pip install --no-deps "
            "kt-kernel==0.7.2` (scripts/setup.sh does) or use KT_BACKEND=torch",
        ) from e
    if not torch.accelerator.is_available():
        experts_base.torch = _torch_without_pinning()  # type: ignore[attr-defined]
        os.environ["KT_FORCE_SYNC_SUBMIT"] = "1"
    wrapper = experts_base.BaseMoEWrapper
    wrapper.select_deferred_experts = _skipping_padding(wrapper.select_deferred_experts)
    return kt_kernel


def _skipping_padding(select: Any) -> Any:
    """``select_deferred_experts`` for ids that may be -1 (padded tokens, see 3. above):
    kt-kernel's own selection runs with padded picks read as expert 0 (which can only keep
    expert 0 from being deferred in that batch), then they come out -1 on both sides.
    Graph-safe: no host sync, fixed shapes."""

    @functools.wraps(select)
    def call(self: Any, expert_ids: torch.Tensor, expert_scores: torch.Tensor, protected_k: int) -> Any:
        padded = expert_ids < 0
        immediate, deferred = select(self, expert_ids.clamp_min(0), expert_scores, protected_k)
        return immediate.masked_fill(padded, -1), deferred.masked_fill(padded, -1)

    return call
