"""Database engines that wrap Django's own under another ENGINE path (as pools and metrics do)."""
