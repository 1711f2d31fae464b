"""``python -m thomas_tune.cli``: the ``thomas-tune`` command."""

import sys

from .main import main

sys.exit(main())
