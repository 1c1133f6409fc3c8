"""``request.idempotency``: what a protected view knows about its claim."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from django_idempotency.scope import Scope


def derive_provider_key(scope: Scope) -> str:
    """A key for the downstream provider, derived only from the scoped key.

    Deterministic, so a restarted process or a reconciler derives the same
    one; hashed, so it fits any provider's key limits and reveals nothing of
    the tenant or the client's key.
    """
    material = json.dumps([scope.tenant, scope.operation, scope.key])
    return hashlib.sha256(material.encode("ascii")).hexdigest()


@dataclass(frozen=True)
class IdempotencyContext:
    scope: Scope
    fencing_token: int

    @property
    def key(self) -> str:
        return self.scope.key

    @property
    def tenant(self) -> str:
        return self.scope.tenant

    @property
    def operation(self) -> str:
        return self.scope.operation

    @property
    def provider_key(self) -> str:
        return derive_provider_key(self.scope)
