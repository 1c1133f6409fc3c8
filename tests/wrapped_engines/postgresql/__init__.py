"""Django's postgresql backend under another ENGINE path."""
