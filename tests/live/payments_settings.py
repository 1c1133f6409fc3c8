"""The demo project's settings under the matrix's configuration (tests/configurations/).

The crash tests serve the demo project (``testproject.settings``); this
module applies ``IDEMPOTENCY_TEST_CONFIGURATION`` to it, as
``tests/settings.py`` does to the suite's own settings.
"""

from __future__ import annotations

from testproject.settings import *  # noqa: F403

from tests.configurations import apply as _apply_configuration

_apply_configuration(globals())
