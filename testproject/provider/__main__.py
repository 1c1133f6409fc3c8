"""``python -m provider --port 8765 --ledger provider.sqlite3`` (from ``testproject/``)."""

import sys

from provider.server import main

sys.exit(main())
