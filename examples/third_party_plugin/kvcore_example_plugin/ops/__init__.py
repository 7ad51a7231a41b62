"""The example plugin's kernels (pure torch here; a vendor plugin keeps its Triton kernels and
its compiled-extension bindings in this package too)."""

from kvcore_example_plugin.ops.gather import gather_pages

__all__ = ["gather_pages"]
