"""The vLLM side: the ``kt-hybrid`` quantization config (``quant_config``), the MoE method
that splits each layer between the native GPU method and a CPU backend (``moe_method``),
its per-layer timing (``metrics``) and the routing recorder behind ``vllm-kt profile``
(``routing_recorder``)."""
