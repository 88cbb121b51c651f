"""What the tests share and are not tests themselves: fixtures, servers, worker processes, checkers.

`fixtures` and `figures` are pytest plugins, loaded for every suite by the root conftest.py.
The worker programs run as ``python -m tests.support.NAME`` from the repository root.
"""
