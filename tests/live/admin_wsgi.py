"""The demo project (testproject) as the admin's browser tests serve it.

``gunicorn tests.live.admin_wsgi:application``, with ``DATABASE_URL`` set:
``testproject.wsgi`` plus the admin's CSS and JavaScript (Django's
``StaticFilesHandler``, as ``runserver --insecure`` serves them with DEBUG
off), so the admin works and looks as it does behind a real static-files
server, and the screenshots the docs use show it styled. The payments app
registers its reconciler (``payments.reconcilers``) as it loads.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

_TESTPROJECT = str(Path(__file__).resolve().parents[2] / "testproject")
if _TESTPROJECT not in sys.path:
    sys.path.insert(0, _TESTPROJECT)
os.environ["DJANGO_SETTINGS_MODULE"] = "testproject.settings"

from django.contrib.staticfiles.handlers import StaticFilesHandler  # noqa: E402
from django.core.wsgi import get_wsgi_application  # noqa: E402

application = StaticFilesHandler(get_wsgi_application())
