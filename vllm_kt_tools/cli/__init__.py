"""``vllm-kt``: one module per command (``demo``, ``doctor``, ``profile``, ``bench``,
``make_tiny_model``), each with ``add_arguments(parser)`` and ``run(args)``; ``main``
dispatches. A new command is a new module here plus one line in ``main.COMMANDS``."""
