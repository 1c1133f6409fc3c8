"""Running a protected view or task: the machinery behind ``@idempotent``.

Owns the request's path from its key to its answer: reading the key
(``keys``), the flow itself (``flow``: fingerprint, claim, run, settle,
answer), the one value a request ends with and its announcement
(``outcome``), the run of the view that both modes share (``run``), the
default mode's claim and what a failure leaves (``owned``), the
write-once ``optimistic`` mode, the answers to everybody who does not run the
view and how refusals are rendered (``answers``), the transactions a view
runs in (``transactions``), the retention header (``retention``), the
consumer side of tasks (``task``, the run loop every framework shares, with
what Celery adds in ``celery_task`` and what Django's Tasks framework adds
in ``django_task``), the staged crash of the test helpers (``crash``) and
the system checks of the settings it reads (``checks``).

Imported by the HTTP and task glue (``decorators``, ``drf``, ``tasks``,
``django_tasks``, ``status``), by the package's root (``idempotent_task``)
and by ``context``; it imports the store, observability and
the public value modules below it, never the glue. Private: its modules
may change in any release.
"""
