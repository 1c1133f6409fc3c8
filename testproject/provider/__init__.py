"""A payment provider simulator, run as its own process (see ``server.py``)."""
