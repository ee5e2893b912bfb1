"""The vLLM side: the ``kt-hybrid`` quantization config (``quant_config``) and the MoE
method that splits each layer between the native GPU method and a CPU backend
(``moe_method``), with what the layers of a process share (``process_state``).

A forward is route -> pick a path -> run it, observers told (``contracts``): the staging
path its plan chose (``staging/``) or the CPU-experts path (``cpu_path``), listed in
``paths``; the GPU experts through ``gpu_experts``; observers in ``observers``. The engine
core may load ``scheduler`` (``--scheduler-cls``), which gathers prompts sent together into
one whole-layer forward. ``vllm_compat`` is every vLLM internal we rely on.
"""
