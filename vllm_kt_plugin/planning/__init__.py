"""Deciding where experts live, before any weight loads: how many experts fit the GPU
(``gpu_budget``), which experts go to the GPU (``placement``) and the per-layer plan that
combines them (``layer_plan``), from the model facts below them in ``settings``
(``model_memory``, ``routing_profile``). Pure logic plus vLLM's config; no kernels."""
