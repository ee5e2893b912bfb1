"""The parts of ``vllm-kt bench`` (the command is ``cli/bench.py``): the model shapes
(``shapes``), the runs a sitting makes (``engine_runs``), each in its own process
(``engine_child``), the host record (``host``), vLLM's offloaders and sglang-kt as peers
(``peers``), one-layer timing (``layer_timing``) and the JSON/PNG report (``report``)."""
