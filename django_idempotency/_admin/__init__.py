"""The admin's machinery: resolving actions, the overview page and its charts.

``actions`` holds the guarded, logged actions and what the admin accepts
from URLs and forms; ``figures`` gathers the overview's numbers in a few
bounded queries; ``overview`` renders them; ``charts`` draws the SVG bars.
The ``ModelAdmin`` classes users may subclass are in
``django_idempotency.admin``.

Imported only by ``django_idempotency.admin``; it writes records only
through the store, and imports neither observability nor the request
path's internals. Private: its modules may change in any release.
"""
