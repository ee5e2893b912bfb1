"""The kt-kernel backend: its experts (``backend``), what each kt-kernel method reads and
needs (``methods``), the online AMX weight cache (``weight_cache``) and the workarounds
for kt-kernel 0.7.2's breaks, kept in one place (``compat``)."""
