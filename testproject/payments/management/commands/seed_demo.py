"""``manage.py seed_demo``: the demo users, idempotently.

Creates (or resets) "alice" and "bob" with fixed DRF tokens and a superuser
"admin" with password "admin". Public credentials: never run this against a
database that matters.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction
from rest_framework.authtoken.models import Token

from payments.demo_data import ADMIN_PASSWORD, ADMIN_USERNAME, DEMO_TOKENS


class Command(BaseCommand):
    help = "Create the demo users alice and bob (fixed API tokens) and the superuser admin/admin."

    @transaction.atomic
    def handle(self, *args: Any, **options: Any) -> None:
        User = get_user_model()
        for username, key in DEMO_TOKENS.items():
            user, created = User.objects.get_or_create(username=username)
            if created:
                user.set_unusable_password()
                user.save(update_fields=["password"])
            # A token's key is its primary key: replace a token with another key.
            Token.objects.filter(user=user).exclude(key=key).delete()
            Token.objects.get_or_create(user=user, defaults={"key": key})
            self.stdout.write(
                f"{'created' if created else 'kept'} user {username!r}, "
                f"token {key} (Authorization: Token {key})"
            )

        admin, created = User.objects.get_or_create(username=ADMIN_USERNAME)
        admin.is_staff = admin.is_superuser = admin.is_active = True
        if created or not admin.check_password(ADMIN_PASSWORD):
            admin.set_password(ADMIN_PASSWORD)
        admin.save()
        self.stdout.write(
            f"{'created' if created else 'kept'} superuser "
            f"{ADMIN_USERNAME!r} / {ADMIN_PASSWORD!r} for /admin/"
        )
        self.stdout.write(self.style.SUCCESS("Demo data ready."))
