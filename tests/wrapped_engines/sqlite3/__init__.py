"""Django's sqlite3 backend under another ENGINE path."""
