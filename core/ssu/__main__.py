"""``python -m ssu ...`` is the ``ssu`` command."""

import sys

from .cli.main import main

sys.exit(main())
