"""An example kvcore plugin: the ``SDPA_GATHER`` attention backend and the ``example_memory``
KV connector. Copy this distribution to start your own; see README.md."""

__version__ = "0.1.0"
