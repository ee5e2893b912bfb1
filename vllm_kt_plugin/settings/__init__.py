"""The KT_* settings, bottom to top: ``catalogue`` (every variable; imports nothing else
of the package), ``errors`` (the one error type), the model facts the settings check
against (``model_memory``: weight sizes from a config.json; ``routing_profile``:
KT_EXPERT_PROFILE files), ``variables`` (parse and check the environment), ``presets``
(KT_CONFIG files) and ``loader`` (preset -> variables -> routing profile: what the rest of
the package calls). A new setting starts in the catalogue. Nothing here imports planning,
the layers or the backends."""
