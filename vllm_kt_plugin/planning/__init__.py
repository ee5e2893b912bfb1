"""Deciding where experts live, before any weight loads: model weight sizes
(``model_memory``), how many experts fit the GPU (``gpu_budget``), routing profiles
(``routing_profile``), which experts go to the GPU (``placement``) and the per-layer plan
that combines them (``layer_plan``). Pure logic plus vLLM's config; no kernels."""
