"""``python -m kvcore.cli``: the ``kvcore`` command."""

import sys

from kvcore.cli.main import main

sys.exit(main())
