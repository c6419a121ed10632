"""`python -m aiobasert`: the same as the `aiobasert` command."""

import sys

from .cli import main

sys.exit(main())
