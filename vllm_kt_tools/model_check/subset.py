"""The architectures CI checks: one per distinct MoE layer class kt-hybrid's method is given
(vLLM's ``RoutedExperts`` and the subclasses models build: the Transformers backend's, gpt-oss's
with its own expert loader and the torch backend's math), each on a model that the full run
serves (docs/model_checks/)."""

from __future__ import annotations

CI_SUBSET: dict[str, str] = {
    "Qwen3NextForCausalLM": "RoutedExperts (shared expert behind a gate, hybrid linear attention)",
    "HunYuanMoEV1ForCausalLM": "TransformersRoutedExperts (vLLM's Transformers backend)",
    "GptOssForCausalLM": "GptOssRoutedExperts (biases, clamped SwiGLU: the torch backend)",
    # not a layer class of its own: the reference loads the plugin's fix of vLLM's CPU router
    "MiniMaxM2ForCausalLM": "RoutedExperts behind a sigmoid router without groups (kt_cpu_router)",
}
