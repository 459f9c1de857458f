"""``python -m lily.bench``: ``lily bench``, and the entry point of its worker processes."""

import sys

from lily.bench.cli import main

sys.exit(main())
