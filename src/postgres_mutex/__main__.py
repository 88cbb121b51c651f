"""``python -m postgres_mutex``: the ``postgres-mutex`` command."""

import sys

from .cli import main

sys.exit(main())
