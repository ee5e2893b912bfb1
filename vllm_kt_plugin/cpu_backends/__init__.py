"""CPU-expert backends, found through pluggy: the two built in and any installed plugin's."""

from __future__ import annotations

import functools

import pluggy

from vllm_kt_plugin import hookspecs
from vllm_kt_plugin.cpu_backends.base import CheckpointFormat, CPUExperts, LayerSpec
from vllm_kt_plugin.env_config import error_for

__all__ = ["CheckpointFormat", "CPUExperts", "LayerSpec", "available_backends", "backend_class"]


@functools.cache
def plugin_manager() -> pluggy.PluginManager:
    from vllm_kt_plugin.cpu_backends import kt_kernel_backend, torch_backend

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(kt_kernel_backend)
    pm.register(torch_backend)
    pm.load_setuptools_entrypoints(hookspecs.ENTRY_POINT_GROUP)
    return pm


def available_backends(pm: pluggy.PluginManager | None = None) -> dict[str, type[CPUExperts]]:
    """Every backend by name; two plugins claiming one name is an error."""
    pm = pm or plugin_manager()
    backends: dict[str, type[CPUExperts]] = {}
    for provided in pm.hook.kt_cpu_backends():
        for name, cls in provided.items():
            if name in backends and backends[name] is not cls:
                raise RuntimeError(
                    f"two kt-hybrid CPU backends are named {name!r}: {backends[name].__module__} and {cls.__module__}"
                )
            if not (isinstance(cls, type) and issubclass(cls, CPUExperts)):
                raise TypeError(f"kt-hybrid backend {name!r} is not a CPUExperts subclass: {cls!r}")
            backends[name] = cls
    return backends


def backend_class(name: str) -> type[CPUExperts]:
    backends = available_backends()
    if name not in backends:
        raise error_for("KT_BACKEND", name, f"installed backends: {', '.join(sorted(backends))}")
    return backends[name]
