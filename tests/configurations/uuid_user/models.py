from __future__ import annotations

import uuid

from django.contrib.auth.models import AbstractUser
from django.db import models


class User(AbstractUser):
    """``AUTH_USER_MODEL`` with a UUID primary key, as many projects start with."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
