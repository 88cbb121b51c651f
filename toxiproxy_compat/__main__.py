"""``python -m toxiproxy_compat``: the server in the foreground (see `toxiproxy_compat.server.main`)."""

import sys

from .server import main

sys.exit(main())
