"""The example plugin's attention backends, one module each: ``SDPA_GATHER``
(:mod:`kvcore_example_plugin.backends.sdpa_gather`)."""
