"""``python -m bench``: see `bench.runner`."""

from bench.runner import main

raise SystemExit(main())
