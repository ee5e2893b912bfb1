"""A layer's forward paths, in the order they are asked: the first whose ``takes``
accepts a forward runs it (``contracts.ForwardPath``).

Each builder looks at the layer (``contracts.LayerParts``) once, when vLLM builds it, and
returns its path, or None where that path is off for the layer. A new path is a module
with a ``ForwardPath`` and a builder, added here in its place. Staging's builder returns
the one staging path its plan chose (the whole layer or the split); the CPU-experts path
takes every forward left.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_kt_plugin.hybrid import cpu_path
from vllm_kt_plugin.hybrid.contracts import ForwardPath, LayerParts
from vllm_kt_plugin.hybrid.staging import build as staging

PATH_BUILDERS: tuple[Callable[[LayerParts], ForwardPath | None], ...] = (
    staging.build,  # forwards the plan stages: the whole layer or a part of its CPU experts on the GPU
    cpu_path.build,  # every forward: CPU experts beside the GPU experts (last: it takes all)
)


def build_paths(parts: LayerParts) -> list[ForwardPath]:
    return [path for build in PATH_BUILDERS if (path := build(parts)) is not None]
