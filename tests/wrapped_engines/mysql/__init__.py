"""Django's mysql backend under another ENGINE path."""
