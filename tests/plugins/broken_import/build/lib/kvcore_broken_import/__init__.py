"""Test fixture: a plugin whose import fails."""

raise ImportError("kvcore_broken_import needs libacme.so, which is not installed")
