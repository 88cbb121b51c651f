"""The server's tests: Toxiproxy's documented behaviour, on whichever server chaos.toxiproxy picks."""
