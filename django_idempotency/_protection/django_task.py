"""What ``idempotent_task`` needs to know of Django's Tasks framework.

The run loop (``task``) is the same for every framework. Django's Tasks
framework (``django.tasks`` from Django 6.0, the ``django-tasks`` backport
before) adds one thing: a task declared with ``@task(takes_context=True)``
is called with a ``TaskContext`` as its first argument, which is the
worker's, not the caller's input. It is left out of the task's
fingerprint: it differs on every run (the result id, the attempt), so
counting it would make every duplicate "the key reused with other
arguments".

Neither framework is imported here: a ``TaskContext`` can only exist once
its module is imported, so ``sys.modules`` is where its class is looked
for. Both homes are looked at, since the backport may be installed beside
Django 6.0.
"""

from __future__ import annotations

import sys
from typing import Any

#: The modules that define ``TaskContext`` and ``Task``: Django's own, and the backport's.
_FRAMEWORK_MODULES = ("django.tasks.base", "django_tasks.base")


def is_task_context(value: Any) -> bool:
    """Whether ``value`` is the ``TaskContext`` a ``takes_context`` task is called with."""
    return _is_instance_of("TaskContext", value)


def is_task(value: Any) -> bool:
    """Whether ``value`` is a Tasks framework ``Task`` (what ``@task`` returns)."""
    return _is_instance_of("Task", value)


def _is_instance_of(name: str, value: Any) -> bool:
    for module_name in _FRAMEWORK_MODULES:
        cls = getattr(sys.modules.get(module_name), name, None)
        if isinstance(cls, type) and isinstance(value, cls):
            return True
    return False
