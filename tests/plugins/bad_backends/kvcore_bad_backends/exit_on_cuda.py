"""A backend module that ends the process at import (registered for cuda)."""

import sys

sys.exit(7)
