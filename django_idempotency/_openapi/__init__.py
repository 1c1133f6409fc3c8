"""drf-spectacular integration: protected operations and the status view document themselves.

``views`` adds the key header and the refusals to every protected
operation; ``status`` describes the operation status view. Importing this
package registers both extensions; ``apps.IdempotencyConfig.ready`` does
so when drf-spectacular is installed. Imports the glue it describes;
nothing imports it but the app config. Private.
"""

from django_idempotency._openapi import status, views

__all__ = ["status", "views"]
