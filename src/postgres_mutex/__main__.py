"""``python -m postgres_mutex``: the ``postgres-mutex`` command."""

import sys

from ._cli import main

sys.exit(main())
