"""The vLLM internals the tooling relies on, in one module, as the runtime keeps its own in
``vllm_kt_plugin/hybrid/vllm_compat.py``: layers built and run outside an engine (the unit
tests, the layer benchmarks), tiny quantized checkpoints written in vLLM's own formats,
the routing recorder's hook, an engine's shutdown and the model registry's table.

``TOUCHES`` lists each; tests/unit/test_vllm_compat.py checks them on the installed vLLM, and
outside this module the tools use only the public interfaces on the allow-lists of
tests/unit/test_layout.py and test_vllm_compat.py. vLLM is imported inside each function.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

from vllm_kt_plugin.hybrid.vllm_compat import Touch

QUANT_UTILS = "vllm.model_executor.layers.quantization.utils.quant_utils"

TOUCHES: tuple[Touch, ...] = (
    Touch(
        "vllm.model_executor.models.registry",
        "_VLLM_MODELS",
        "owner",
        "the registry's own table, architecture -> (module, class): the supported-models page lists it",
    ),
    Touch(
        "vllm.transformers_utils.config",
        "_CONFIG_REGISTRY",
        "owner",
        "vLLM's own config classes, model_type -> class: whether a tiny model's config class ships",
    ),
    Touch(
        "vllm.distributed",
        "init_distributed_environment",
        "owner",
        "a one-process world, as a worker starts one, for building MoE layers outside an engine",
    ),
    Touch("vllm.distributed", "initialize_model_parallel", "owner", "its tensor/pipeline groups, of size 1"),
    Touch("vllm.utils.network_utils", "get_open_port", "owner", "a free port for that world's rendezvous"),
    Touch(
        "vllm.v1.worker.workspace",
        "init_workspace_manager",
        "owner",
        "the modular MoE kernels' scratch buffers, which a worker creates before any layer runs",
    ),
    Touch(
        "vllm.forward_context",
        "set_forward_context",
        "owner",
        "the context a layer's forward reads (the op finds its layer there), outside an engine's forward",
    ),
    Touch(
        "vllm.model_executor.layers.fused_moe.router.base_router",
        "BaseRouter",
        "owner",
        "every MoE router's base class: the bench's routing recorder attaches in its __init__",
    ),
    Touch(
        "vllm.utils.deep_gemm",
        "per_block_cast_to_fp8",
        "owner",
        "block-FP8 weights and scales as vLLM's Fp8 loader reads them (tiny block-FP8 checkpoints)",
    ),
    Touch(QUANT_UTILS, "quantize_weights", "owner", "symmetric INT4 groups (tiny compressed-tensors checkpoints)"),
    Touch(QUANT_UTILS, "gptq_quantize_weights", "owner", "GPTQ INT4 groups (tiny GPTQ checkpoints)"),
    Touch(QUANT_UTILS, "gptq_pack", "owner", "GPTQ's qweight packing, as vLLM's GPTQ loader reads it"),
    Touch(QUANT_UTILS, "pack_cols", "owner", "GPTQ's qzeros packing"),
    Touch("vllm.scalar_type", "scalar_types", "owner", "the INT4 types those quantizers take"),
    Touch(
        "vllm.v1.engine.llm_engine:LLMEngine",
        "engine_core",
        "init",
        "an LLM's engine core client, whose shutdown frees the engine's GPU memory in this process",
    ),
)


def routed_experts(runner: Any) -> Any:
    """The RoutedExperts layer (the one its quant method is given) of a model's MoE runner."""
    return runner.routed_experts


def cpu_has_amx_tiles() -> bool:
    """Whether this CPU has AMX tiles, as vLLM's CPU build asks (torch's private check)."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported())  # type: ignore[attr-defined]


def registry_models() -> Mapping[str, tuple[str, str]]:
    """vLLM's model registry: architecture -> (module, class)."""
    from vllm.model_executor.models.registry import _VLLM_MODELS

    return _VLLM_MODELS


def model_class(architecture: str) -> Any:
    """vLLM's model class of a registry architecture, imported as the registry would."""
    import importlib

    module, cls = registry_models()[architecture]
    name = module if module.startswith("vllm.") else f"vllm.model_executor.models.{module}"
    return getattr(importlib.import_module(name), cls)


def config_registry() -> Mapping[str, type]:
    """vLLM's config registry: model_type -> the config class vLLM ships for it."""
    from vllm.transformers_utils.config import _CONFIG_REGISTRY

    return _CONFIG_REGISTRY


def init_single_process_groups(backend: str) -> None:
    """vLLM's distributed state and parallel groups for one process (world size 1)."""
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.utils.network_utils import get_open_port

    init_distributed_environment(
        world_size=1,
        rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}",
        local_rank=0,
        backend=backend,
    )
    initialize_model_parallel(1, 1)


def init_workspace(device: Any) -> None:
    from vllm.v1.worker.workspace import init_workspace_manager

    init_workspace_manager(device)


def forward_context(vllm_config: Any) -> AbstractContextManager[Any]:
    from vllm.forward_context import set_forward_context

    return set_forward_context(None, vllm_config)


def moe_router_class() -> type:
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    return BaseRouter


def per_block_cast_to_fp8(weight: Any, block: list[int]) -> tuple[Any, Any]:
    from vllm.utils.deep_gemm import per_block_cast_to_fp8 as cast

    return cast(weight, block)


def quantize_int4(weight: Any, group: int) -> tuple[Any, ...]:
    """vLLM's symmetric INT4 quantizer (``quantize_weights`` with ``scalar_types.int4``)."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import quantize_weights
    from vllm.scalar_type import scalar_types

    return quantize_weights(weight, scalar_types.int4, group)


def gptq_int4(weight: Any, group: int) -> tuple[Any, ...]:
    """vLLM's GPTQ INT4 quantizer (``scalar_types.uint4b8``)."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import gptq_quantize_weights
    from vllm.scalar_type import scalar_types

    return gptq_quantize_weights(weight, scalar_types.uint4b8, group)


def gptq_pack(q: Any, bits: int, k: int, n: int) -> Any:
    from vllm.model_executor.layers.quantization.utils.quant_utils import gptq_pack as pack

    return pack(q, bits, k, n)


def pack_cols(q: Any, bits: int, k: int, n: int) -> Any:
    from vllm.model_executor.layers.quantization.utils.quant_utils import pack_cols as pack

    return pack(q, bits, k, n)


def shutdown_engine(llm: Any) -> None:
    """Shut a ``vllm.LLM``'s engine core down in this process."""
    llm.llm_engine.engine_core.shutdown()
