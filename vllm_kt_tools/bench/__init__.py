"""The parts of ``vllm-kt bench`` (the command is ``cli/bench.py``): engine runs, each in
its own process (``engine_runs``), one-layer timing (``layer_timing``) and the JSON/PNG
report (``report``)."""
