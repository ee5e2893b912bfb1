"""Helpers for the demo, the tests and the benchmark: tiny trained MoE checkpoints, a
``vllm serve`` process, MoE layers built as vLLM models build them, and the one protocol
for running a function in a child process and reading its result."""
