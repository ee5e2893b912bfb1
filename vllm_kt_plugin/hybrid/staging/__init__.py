"""Staging: a layer's CPU experts computed on the GPU, their weights streamed in per forward.

``plan`` decides, once per layer, whether and how (pure: planning, serve's checks and
doctor ask it too). ``build`` makes the path it chose: ``whole_layer`` (every CPU expert
staged) or ``split`` (a part, the rest on the CPU, as the cost model of ``costs`` with the
constants ``probe`` measures picks). Both hold a ``layer.LayerStaging``: the CPU experts
on the host (``host_experts``, ``fp8_copy``, ``host_memory``) and the device buffers they
stream through (``buffers``).
"""
