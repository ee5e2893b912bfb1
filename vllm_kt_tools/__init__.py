"""Tooling around vllm-kt-plugin: the ``vllm-kt`` command line (doctor, demo, bench,
profile, make-tiny-model), the benchmark, and the helpers they share (tiny generated
checkpoints, a ``vllm serve`` process, MoE layers built as vLLM builds them).

Apart from the runtime package ``vllm_kt_plugin``: this package imports the runtime, never
the other way round, so serving a model loads none of it."""
