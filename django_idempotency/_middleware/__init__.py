"""What ``IdempotencyMiddleware`` protects, and how: one module per framework.

The middleware (``django_idempotency.middleware``) asks
``frameworks.routed_view()`` about the callback a URL resolved to. Each
framework of ``frameworks.FRAMEWORKS`` is asked in turn and the first that
recognises the callback answers for it: ``drf`` for DRF's views, viewsets
and ``@api_view`` functions, and ``plain`` for every other view (plain
Django views, protected only under ``MIDDLEWARE_PLAIN_VIEW_PREFIXES``).
The answer, a ``coverage.RoutedView``, tells for each unsafe method what
protects it (the middleware, the view's own ``@idempotent`` or
``IdempotentMixin``, or nothing, and why: a ``coverage.Coverage``) and
gives the callable the middleware runs in the view's place.

``keyless`` counts and logs what the report-only rollout lets through;
``checks`` validates the middleware's place in ``MIDDLEWARE`` and its
settings.

Imported by the middleware (``django_idempotency.middleware``) at run
time, and by what lists the protected views: ``_routes`` (the system
checks, the metrics' labels, ``manage.py idempotency_routes``), the
OpenAPI schema (``_openapi``) and ``checks``. It imports the glue it
reuses (``drf``, ``decorators``) and the request path below it, never
what imports it. Private: its modules may change in any release.
"""
