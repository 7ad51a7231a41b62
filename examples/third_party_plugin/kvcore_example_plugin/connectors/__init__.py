"""The example plugin's KV connectors, one module each: ``example_memory``
(:mod:`kvcore_example_plugin.connectors.in_memory`)."""
