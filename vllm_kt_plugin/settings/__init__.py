"""The KT_* settings, bottom to top: ``catalogue`` (every variable; imports nothing else
of the package), ``errors`` (the one error type), ``variables`` (parse and check the
environment), ``presets`` (KT_CONFIG files) and ``loader`` (preset -> variables ->
routing profile: what the rest of the package calls). A new setting starts in the
catalogue."""
