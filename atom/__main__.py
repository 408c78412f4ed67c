"""``python -m atom``: the same as the ``atom-engine`` command."""

import sys

from atom.cli import main

sys.exit(main())
