"""A layer's forward paths, in the order they are asked: the first whose ``takes``
accepts a forward runs it (``contracts.ForwardPath``).

Each builder looks at the layer (``contracts.LayerParts``) once, when vLLM builds it, and
returns its path, or None where that path is off for the layer. A new path is a module
with a ``ForwardPath`` and a builder, added here in its place. GPU prefill's whole-layer
stream and the split (the per-forward split of a layer's CPU experts between the CPU and
the GPU) exclude each other per layer (``staging_policy.splits``); the CPU-experts path
takes every forward left.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_kt_plugin.hybrid import cpu_path, gpu_prefill_path, split_path
from vllm_kt_plugin.hybrid.contracts import ForwardPath, LayerParts

PATH_BUILDERS: tuple[Callable[[LayerParts], ForwardPath | None], ...] = (
    gpu_prefill_path.build,  # forwards of >= KT_GPU_PREFILL_MIN_TOKENS: every expert on the GPU
    split_path.build,  # or instead: a part of the CPU experts on the GPU, the rest on the CPU
    cpu_path.build,  # every forward: CPU experts beside the GPU experts (last: it takes all)
)


def build_paths(parts: LayerParts) -> list[ForwardPath]:
    return [path for build in PATH_BUILDERS if (path := build(parts)) is not None]
