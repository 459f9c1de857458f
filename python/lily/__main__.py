"""``python -m lily``: the same as the ``lily`` command."""

import sys

from lily.cli import main

sys.exit(main())
