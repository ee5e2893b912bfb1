"""The vLLM side: the ``kt-hybrid`` quantization config (``quant_config``) and the MoE
method that splits each layer between the native GPU method and a CPU backend
(``moe_method``).

A forward is route -> pick a path -> run it, observers told (``contracts``). Paths, in the
order ``paths`` asks them: GPU prefill (``gpu_prefill_path``: every CPU expert streamed to
the GPU, from the host copy of ``host_experts`` through ``staging_buffers``), or in its
place the split (``split_path``: per forward, a part of the CPU experts staged on the GPU,
the rest on the CPU, as ``split_cost``'s model, probed by ``split_probe``, decides), as
``staging_policy`` says, and the CPU-experts path (``cpu_path``); all compute the GPU
experts through ``gpu_experts``. Observers: the routing recorder (``routing_recorder``,
behind ``vllm-kt profile``), per-layer timing (``metrics``, ``device_clock``), the bench's
per-forward timeline (``timeline``) and dynamic GPU experts (``dynamic_experts``), wired
by ``observers``. ``process_state`` holds what the layers of a process share; a layer
reaches it through the Protocol ``contracts.ProcessState``, so nothing below the config,
the method and the process state imports them. ``shadow`` builds copies of a layer that
own their weights; ``vllm_compat`` is every vLLM internal we rely on. Beside the layers,
vLLM's engine core may load ``scheduler`` by name (``--scheduler-cls``): prompts sent
together held back into one forward that streams the whole layer (``admission`` decides)."""
