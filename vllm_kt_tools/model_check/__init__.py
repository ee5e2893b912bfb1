"""The model check: every MoE architecture of vLLM's registry, served through kt-hybrid.

For each architecture a tiny model is written from the config class transformers or vLLM
ships (``recipes``, ``checkpoint``), plain vLLM and ``vllm serve --quantization kt-hybrid``
answer the same greedy prompts (``engines``), and the answers are compared as the
end-to-end tests compare them (``compare``). ``run`` writes one JSON per run; the
Supported-models table (``vllm_kt_tools.support.supported_models``) is generated from
the committed one. ``vllm-kt check-models`` runs it.
"""
