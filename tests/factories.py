from __future__ import annotations

from datetime import timedelta
from typing import Any

import factory
from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from django.utils import timezone
from rest_framework.authtoken.models import Token

from django_idempotency.models import IdempotencyRecord


# User: what mypy's Django plugin takes get_user_model() to be under tests.settings.
class UserFactory(factory.django.DjangoModelFactory[User]):
    class Meta:
        model = get_user_model()
        django_get_or_create = ("username",)

    username = factory.Sequence(lambda n: f"user{n}")


class TokenFactory(factory.django.DjangoModelFactory[Token]):
    class Meta:
        model = Token

    user: factory.SubFactory[Any, User] = factory.SubFactory(UserFactory)


class RecordFactory(factory.django.DjangoModelFactory[IdempotencyRecord]):
    class Meta:
        model = IdempotencyRecord

    tenant = "anonymous"
    operation = "POST api-view/charges"
    key = factory.Sequence(lambda n: f"key-{n}")
    fingerprint = "0" * 64
    state = IdempotencyRecord.State.COMPLETED
    response_status = 201
    response_headers = factory.LazyFunction(lambda: [["Content-Type", "application/json"]])
    response_body = b'{"stored": true}'
    created_at = factory.LazyFunction(timezone.now)
    updated_at = factory.LazyFunction(timezone.now)
    expires_at = factory.LazyFunction(lambda: timezone.now() + timedelta(hours=1))
