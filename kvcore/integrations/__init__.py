"""Adapters for engines that drive kvcore's backends on memory and metadata the engine owns.

- :mod:`kvcore.integrations.transformers`: Hugging Face transformers' continuous batching
  (``generate_batch``, ``ContinuousBatchingManager``, ``transformers serve``) on a kvcore
  backend, viewing transformers' own paged cache (extra ``kvcore[transformers]``).

Nothing here is imported by ``import kvcore``; each adapter imports its engine lazily, so the
package imports without any engine installed.
"""
