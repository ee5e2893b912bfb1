"""The vLLM side: the ``kt-hybrid`` quantization config (``quant_config``) and the MoE
method that splits each layer between the native GPU method and a CPU backend
(``moe_method``), with what the layers of a process share (``process_state``).

A forward is route -> pick a path (``paths``: ``staging/`` or ``cpu_path``) -> run it,
observers told (``contracts``, ``observers``). ``scheduler`` (``--scheduler-cls``) gathers
prompts sent together into one forward; ``vllm_compat`` is every vLLM internal we rely on.
The whole stack: docs/design.md, "Shape of the code".
"""
