"""``kvcore demo``: a small model served end to end over kvcore, every token checked.

- :mod:`kvcore.demo.scenario`: the demo itself (:func:`~kvcore.demo.scenario.run_demo`), from
  selection to the checks, and its summary;
- :mod:`kvcore.demo.engine`: a minimal serving engine over kvcore (block pool, continuous
  batching, prefix reuse through a connector): what an engine does every step;
- :mod:`kvcore.demo.model`: a small Llama-shaped transformer with fixed random weights;
- :mod:`kvcore.demo.config`: its sizes and the ``--model`` presets (no torch needed).
- :mod:`kvcore.demo.disagg`: disaggregated prefill/decode, two processes with KV through the
  ``nixl`` connector (``kvcore demo --disaggregated``).

Like :mod:`kvcore.cli`, it uses kvcore's public API only. Nothing is imported here, so the
``kvcore`` command reads the presets without importing torch.
"""
