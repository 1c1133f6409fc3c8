"""What a record's tenant and operation may hold as they are: sizes and characters.

No model and nothing of the package is imported here, so that a decorator
can judge a fixed operation name when it decorates: a Celery task module is
often imported before Django's apps are ready (by the Celery app, by a
settings file), where importing ``models`` would fail. ``models`` takes the
column sizes from here, ``scope`` offers the rule to users, and the task
decorator imports it directly.
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

#: The sizes of the record's tenant and operation columns (``models.py``
#: takes them from here, and says why they are these).
TENANT_MAX_LENGTH = 128
OPERATION_MAX_LENGTH = 255


def unprintable_character(text: str) -> str | None:
    """The first character of ``text`` that no record should hold as it is, or None.

    PostgreSQL refuses a NUL in text (an error in the middle of a claim or a
    lookup), a lone surrogate cannot be encoded for any database, and a
    control character (ESC, CR) or a bidirectional override would reach an
    operator's terminal through the commands and the logs that print it.
    """
    if text.isprintable():
        return None
    return next(char for char in text if not char.isprintable())


def operation_name_fault(name: str) -> str | None:
    """What keeps ``name`` from naming an operation, or None when nothing does.

    An operation name is 1 to ``OPERATION_MAX_LENGTH`` printable characters,
    the rule step names obey too: a longer name does not fit the column, and
    an unprintable one is refused as ``unprintable_character`` says why.
    """
    if not name:
        return "is empty"
    if len(name) > OPERATION_MAX_LENGTH:
        return f"is longer than {OPERATION_MAX_LENGTH} characters"
    unprintable = unprintable_character(name)
    if unprintable is not None:
        return f"holds the control or unprintable character U+{ord(unprintable):04X}"
    return None


def check_operation_spec(spec: object) -> None:
    """Refuse, at decoration, an ``operation=`` that names no operation.

    Raises:
        ImproperlyConfigured: ``spec`` is a name no record can hold, or is
            neither ``None``, a string nor a callable.
    """
    if spec is None or callable(spec):
        return
    if not isinstance(spec, str):
        raise ImproperlyConfigured(
            f"operation={spec!r} must be a name (a string), a callable or None."
        )
    fault = operation_name_fault(spec)
    if fault is not None:
        raise ImproperlyConfigured(
            f"The operation name {spec!r} {fault}: an operation name is 1 to "
            f"{OPERATION_MAX_LENGTH} printable characters."
        )
