"""CPU-expert backends, found through pluggy: the two built in and any installed plugin's.

The manager checks every registered hook implementation against the hook specs
(``check_pending``), so a third-party backend with a misspelled hook fails loudly
instead of silently never being offered.
"""

from __future__ import annotations

import functools

import pluggy

from vllm_kt_plugin import hookspecs
from vllm_kt_plugin.cpu_backends import torch_backend
from vllm_kt_plugin.cpu_backends.base import CPUExperts
from vllm_kt_plugin.cpu_backends.kt_kernel import backend as kt_kernel_backend
from vllm_kt_plugin.settings.errors import KTConfigError


@functools.cache
def plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(kt_kernel_backend)
    pm.register(torch_backend)
    pm.load_setuptools_entrypoints(hookspecs.ENTRY_POINT_GROUP)
    pm.check_pending()
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
        raise KTConfigError("KT_BACKEND", name, f"installed backends: {', '.join(sorted(backends))}")
    return backends[name]
