"""pluggy extension points of vllm-kt-plugin: a third-party package adds a CPU-expert
backend by implementing the ``kt_cpu_backends`` hook in a module it names under the
entry-point group ``vllm_kt_plugin.cpu_backends``; users select it with ``KT_BACKEND``.
The full example: docs/design.md, "Extension point: CPU backends"."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from vllm_kt_plugin.cpu_backends.base import CPUExperts

PROJECT = "vllm_kt_plugin"
ENTRY_POINT_GROUP = "vllm_kt_plugin.cpu_backends"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def kt_cpu_backends() -> dict[str, type[CPUExperts]]:  # type: ignore[empty-body]
    """Return the CPU-expert backends this plugin provides, keyed by ``KT_BACKEND`` name.

    Each value is a :class:`~vllm_kt_plugin.cpu_backends.base.CPUExperts` subclass; one
    instance is built per MoE layer. Names must be unique across installed plugins.
    """
