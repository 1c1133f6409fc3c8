"""Keyed, versioned digests of guessable input: fingerprints, provider keys, who asked.

A bare SHA-256 of a request's canonical input, or of (tenant, operation,
key), is reversed by trying the likely inputs: a fingerprint gave its amount
back in 0.13 s, a provider key its tenant and key in 0.03 s. So both are
HMAC-SHA256 under a server secret (``IDEMPOTENCY["DIGEST_KEYS"]``, by
default derived from ``SECRET_KEY`` and ``SECRET_KEY_FALLBACKS``), written
as ``"<version>:<hex>"`` so that a stored digest names the secret it was
made with. New digests use the first (newest) secret; a fingerprint is
compared under every listed one, so rotating the secret does not turn a
retry into a 422. A stored fingerprint without a version matches nothing:
every release writes the version.

The principal that sent a record's first request, and (views that rotate
it) the credential it presented, are kept the same way: a bare hash of a
user id or of a short API key would be reversed by trying them. So is the
tenant of a client whose authentication names it by a bare string (a Django
Ninja API key): the tenant column is shown in the admin and kept for the
records' retention.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from functools import lru_cache

from django_idempotency.conf import idempotency_settings

#: ``hmac.digest`` without its Python layer where OpenSSL's is there.
try:
    from _hashlib import hmac_digest as _digest
except ImportError:  # pragma: no cover - a Python built without OpenSSL
    _digest = hmac.digest  # type: ignore[assignment]

#: Some providers take idempotency keys of at most 64 characters.
PROVIDER_KEY_MAX_LENGTH = 64
#: Separates a digest's secret version from its hex digits.
VERSION_SEPARATOR = ":"
#: The salt that makes this package's keys its own, whatever the secret
#: is also used for (``SECRET_KEY`` signs sessions, too). Part of every
#: stored digest: it names where the module once lived and never changes.
_SALT = "django_idempotency.digests"


@dataclass(frozen=True)
class _Secret:
    version: str
    #: One HMAC per purpose, keyed once, copied per digest: a fingerprint
    #: and a provider key never share a key.
    fingerprint_mac: hmac.HMAC
    provider_key_mac: hmac.HMAC
    principal_mac: hmac.HMAC
    credential_mac: hmac.HMAC
    tenant_mac: hmac.HMAC
    #: The fingerprint's key itself: a canonical form that arrives whole (a
    #: request's, nearly always) is digested in one call, no HMAC copied.
    fingerprint_key: bytes


def _derive(purpose: str, secret: bytes) -> bytes:
    # As Django's salted_hmac() keys itself: hash(salt + secret).
    return hashlib.sha256(f"{_SALT}.{purpose}".encode() + secret).digest()


@lru_cache(maxsize=8)
def _secrets(keys: tuple[tuple[str | None, bytes], ...]) -> tuple[_Secret, ...]:
    return tuple(
        _Secret(
            default_version(secret) if version is None else version,
            hmac.new(_derive("fingerprint", secret), digestmod="sha256"),
            hmac.new(_derive("provider-key", secret), digestmod="sha256"),
            hmac.new(_derive("principal", secret), digestmod="sha256"),
            hmac.new(_derive("credential", secret), digestmod="sha256"),
            hmac.new(_derive("tenant", secret), digestmod="sha256"),
            _derive("fingerprint", secret),
        )
        for version, secret in keys
    )


def active_secrets() -> tuple[_Secret, ...]:
    """The configured secrets, newest first."""
    return _secrets(idempotency_settings.DIGEST_KEYS)


def default_version(secret: bytes) -> str:
    """A stable version id for a secret given without one (``SECRET_KEY``)."""
    return "sk" + hashlib.sha256(_derive("version", secret)).hexdigest()[:8]


@dataclass(frozen=True)
class Fingerprint:
    """A request's fingerprint under every active secret, computed once."""

    #: What a new record stores: ``"<version>:<hex>"`` under the newest secret.
    stored: str
    #: (version, hex digest) for every active secret, newest first.
    by_version: tuple[tuple[str, str], ...]

    def matches(self, stored: str) -> bool:
        """Whether ``stored`` (a record's fingerprint) is this request's."""
        version, separator, digest = stored.partition(VERSION_SEPARATOR)
        if not separator:
            return False  # not a digest this package writes
        for known, expected in self.by_version:
            if known == version:
                return hmac.compare_digest(digest.encode(), expected.encode())
        return False  # made with a secret no longer listed


class FingerprintHasher:
    """Takes the canonical form in chunks; ``finish()`` gives the Fingerprint.

    Each chunk goes to one HMAC per active secret: the canonical form is
    produced once and never held whole. The last chunk may be handed to
    ``finish()``: when it is the only one (a request's canonical form
    nearly always is), each secret digests it in one call.
    """

    __slots__ = ("_macs", "_secrets")

    def __init__(self) -> None:
        self._secrets = active_secrets()
        #: Made at the first chunk ``update()`` is given.
        self._macs: list[tuple[str, hmac.HMAC]] | None = None

    def update(self, chunk: str | bytes) -> None:
        data = chunk.encode("utf-8") if isinstance(chunk, str) else chunk
        macs = self._macs
        if macs is None:
            macs = self._macs = [
                (secret.version, secret.fingerprint_mac.copy()) for secret in self._secrets
            ]
        for _, mac in macs:
            mac.update(data)

    def finish(self, last: bytes = b"") -> Fingerprint:
        """The fingerprint of every chunk given, then of ``last``."""
        if self._macs is None:
            by_version = tuple(
                (secret.version, _digest(secret.fingerprint_key, last, "sha256").hex())
                for secret in self._secrets
            )
        else:
            if last:
                self.update(last)
            by_version = tuple((version, mac.hexdigest()) for version, mac in self._macs)
        newest_version, newest = by_version[0]
        return Fingerprint(f"{newest_version}{VERSION_SEPARATOR}{newest}", by_version)


def provider_key(material: bytes) -> str:
    """A versioned HMAC of ``material`` under the newest secret, in 64 characters.

    Written to the record by ``begin_external()`` and read from it ever
    after: a rotated secret never gives an operation a second key.
    """
    secret = active_secrets()[0]
    mac = secret.provider_key_mac.copy()
    mac.update(material)
    return f"{secret.version}{VERSION_SEPARATOR}{mac.hexdigest()}"[:PROVIDER_KEY_MAX_LENGTH]


@dataclass(frozen=True)
class Sender:
    """Who sent the request that claims a record, as the record keeps it: digests.

    Read back only by the narrow paths that answer a retry DRF refused
    before the claim (``_protection/refused.py``).
    """

    #: ``principal_digest()`` of the authenticated principal; None: anonymous.
    principal: str | None = None
    #: ``credential_digest()`` of the credential presented, kept only by
    #: views that rotate or revoke it; None otherwise.
    credential: str | None = None


NOBODY = Sender()


def principal_digest(principal: str) -> str:
    """A versioned HMAC of a principal (``"user:5"``) under the newest secret."""
    return _versioned(active_secrets()[0], "principal_mac", principal)


def principal_digests(principal: str) -> tuple[str, ...]:
    """``principal_digest()`` under every active secret: what a stored one may be."""
    return tuple(_versioned(secret, "principal_mac", principal) for secret in active_secrets())


def credential_digest(credential: str) -> str:
    """A versioned HMAC of a raw credential (an ``Authorization`` header), newest secret."""
    return _versioned(active_secrets()[0], "credential_mac", credential)


def credential_digests(credential: str) -> tuple[str, ...]:
    """``credential_digest()`` under every active secret: what a stored one may be."""
    return tuple(_versioned(secret, "credential_mac", credential) for secret in active_secrets())


def tenant_digest(credential: str) -> str:
    """A versioned HMAC of a credential that names a tenant (an API key), newest secret.

    Stable while the newest secret is: a tenant is the key space of every
    record its client makes, so it must come out the same at each request.
    """
    return _versioned(active_secrets()[0], "tenant_mac", credential)


def _versioned(secret: _Secret, purpose: str, text: str) -> str:
    mac = getattr(secret, purpose).copy()
    mac.update(text.encode("utf-8", "surrogatepass"))
    return f"{secret.version}{VERSION_SEPARATOR}{mac.hexdigest()}"
