"""kt-kernel 0.7.2 workarounds, kept in this one place: allocation without pinned memory
and the synchronous submit path where torch sees no accelerator, padded tokens' -1 picks
kept out of expert deferral, a log line once deferral ran (kt-kernel counts nothing it
defers), and BF16 experts handed over as tensors. What each break is and why the
workaround looks as it does: docs/design.md, "kt-kernel 0.7.2's breaks"."""

from __future__ import annotations

import functools
import logging
import os
import types
from typing import Any

import torch

from vllm_kt_plugin.settings.catalogue import LOGGER_NAME
from vllm_kt_plugin.settings.errors import KTConfigError

logger = logging.getLogger(LOGGER_NAME)

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
    Graph-safe: no host sync, fixed shapes (``DEFERRAL_LOG`` reads counts only outside a
    graph capture, until it has logged)."""

    @functools.wraps(select)
    def call(self: Any, expert_ids: torch.Tensor, expert_scores: torch.Tensor, protected_k: int) -> Any:
        padded = expert_ids < 0
        immediate, deferred = select(self, expert_ids.clamp_min(0), expert_scores, protected_k)
        immediate, deferred = immediate.masked_fill(padded, -1), deferred.masked_fill(padded, -1)
        DEFERRAL_LOG.saw(self, immediate, deferred)
        return immediate, deferred

    return call


class DeferralLog:
    """One INFO line per process, at the first forward that deferred a CPU expert's pick
    (kt-kernel counts nothing it defers; the tests read this line, so that deferral
    silently off fails them)."""

    def __init__(self) -> None:
        self.logged = False

    def saw(self, wrapper: Any, immediate: torch.Tensor, deferred: torch.Tensor) -> None:
        if self.logged or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            return
        on_gpu = wrapper.gpu_experts_mask.to(deferred.device)  # picks kt-kernel skips, deferred or not
        deferred_cpu = int(((deferred >= 0) & ~on_gpu[deferred.clamp_min(0)]).sum())
        if deferred_cpu:
            self.logged = True
            logger.info(
                "kt-hybrid: expert deferral ran: layer %d deferred %d of %d CPU-expert picks to the next layer",
                wrapper.layer_idx,
                deferred_cpu,
                deferred_cpu + int(((immediate >= 0) & ~on_gpu[immediate.clamp_min(0)]).sum()),
            )


DEFERRAL_LOG = DeferralLog()


class _LoadedExperts:
    """Stands in for kt-kernel's safetensors loader (``NativeMoEWrapper``'s class-wide
    ``_native_loader_instance``), handing it one layer's experts as tensors: kt-kernel
    0.7.2's BF16 method reads only files named as its loader expects (``model.layers.N.mlp
    .experts.E.gate_proj.weight`` and two others), and has no ``load_weights_from_tensors``."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        self.experts = {"gate": list(gate.unbind()), "up": list(up.unbind()), "down": list(down.unbind())}

    def load_experts(self, base_key: str) -> dict[str, list[torch.Tensor]]:
        return self.experts

    def close_all_handles(self) -> None:
        return


def load_bf16_from_tensors(
    kt_kernel: types.ModuleType,
    layer_idx: int,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    physical_to_logical: torch.Tensor,
    **wrapper_args: Any,
) -> Any:
    """A BF16 ``KTMoEWrapper`` of one layer whose experts are the given [experts, ...]
    tensors (gate and up [E, I, H], down [E, H, I]), not files: the stand-in loader is
    installed for the wrapper's construction and ``load_weights`` (which copies the experts
    into kt-kernel's own buffers and then releases the loader)."""
    from kt_kernel.utils.amx import NativeMoEWrapper

    NativeMoEWrapper._native_loader_instance = _LoadedExperts(gate, up, down)
    try:
        wrapper = kt_kernel.KTMoEWrapper(layer_idx=layer_idx, weight_path="(tensors)", **wrapper_args)
        wrapper.load_weights(physical_to_logical)
    finally:
        NativeMoEWrapper._native_loader_instance = None
    return wrapper
