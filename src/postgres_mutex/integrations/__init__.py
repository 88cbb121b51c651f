"""Glue for the frameworks where jobs live: each submodule is an optional extra on the public API."""
