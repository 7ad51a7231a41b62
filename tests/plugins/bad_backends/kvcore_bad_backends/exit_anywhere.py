"""A backend module that ends the process at import (platforms not registered)."""

import sys

sys.exit(7)
