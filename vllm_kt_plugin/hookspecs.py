"""pluggy extension points of vllm-kt-plugin.

A third-party package adds a CPU-expert backend by exposing a module (or object) with a
``kt_cpu_backends`` hook implementation under the entry-point group
``vllm_kt_plugin.cpu_backends``::

    # pyproject.toml of the other package
    [project.entry-points."vllm_kt_plugin.cpu_backends"]
    my_backend = "my_pkg.kt_backend"

    # my_pkg/kt_backend.py
    from vllm_kt_plugin.hookspecs import hookimpl
    from vllm_kt_plugin.cpu_backends.base import CPUExperts

    class MyExperts(CPUExperts): ...

    @hookimpl
    def kt_cpu_backends():
        return {"my_backend": MyExperts}

and users select it with ``KT_BACKEND=my_backend``.
"""

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
