"""Programs written against postgres-mutex 0.1.0's README and public API, and nothing newer.

tests/integration/test_upgrade_from_0_1_0.py runs each of them twice: with the published 0.1.0
(installed from PyPI into a virtual environment of its own) and with this version,
as standalone scripts (``python -I path``): they import nothing from this repository.
"""
