"""Test fixture: a plugin module that ends the process at import."""

import sys

sys.exit(3)
