"""CPU-expert backends: the interface (``base``), the registry that finds them through
pluggy (``registry``), and the built-in ones (``torch_backend``, ``kt_kernel/``).

A new backend is a ``CPUExperts`` subclass offered by a ``kt_cpu_backends`` hook
implementation (see ``vllm_kt_plugin.hookspecs``); built-in ones are registered in
``registry.plugin_manager``.
"""
