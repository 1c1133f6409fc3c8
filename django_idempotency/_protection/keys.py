"""Where a request's idempotency key comes from: ``@idempotent(key=...)``.

By default the key is the ``IDEMPOTENCY["HEADER"]`` header a client sends.
A webhook's sender sends no such header, and its key must come from what
its signature covers: anyone holding one signed body can send it again with
any unsigned header. That is a field of the signed body (a Stripe event's
``id``) or, where the body names no event (GitHub, whose delivery id is an
unsigned header), the digest of the signed body itself: ``"digest:body"``.
Wherever it comes from, a key obeys the header's rules (1 to
``KEY_MAX_LENGTH`` visible ASCII characters) and is claimed, completed and
replayed the same way. The header's value is an RFC 8941 string, quoted
or bare (``parse_key``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

from django.core.exceptions import ImproperlyConfigured, RequestDataTooBig
from django.http.request import RawPostDataException
from django.utils.datastructures import MultiValueDict

from django_idempotency.conf import idempotency_settings
from django_idempotency.exceptions import KeyInvalid
from django_idempotency.fingerprint import NestedTooDeeply

if TYPE_CHECKING:
    from django.http import HttpRequest
import re

import http_sf

#: ``None`` (the ``IDEMPOTENCY["HEADER"]`` header), ``"header:<Name>"``,
#: ``"body:<dotted.field>"``, ``"digest:body"``, or a callable taking the request.
KeySpec = str | Callable[[Any], object] | None

_PREFIXES = ("header", "body", "digest")
#: What ``"digest:<what>"`` may take the digest of.
_DIGESTS = ("body",)
_ABSENT = object()


@dataclass(frozen=True)
class KeySource:
    """A parsed ``key=`` spec: where ``read()`` finds a request's key."""

    kind: Literal["header", "body", "digest", "callable"] = "header"
    #: The header's name, the body field's dotted path, or what a digest is
    #: of ("body"); "" for the ``IDEMPOTENCY["HEADER"]`` header (read at
    #: each request).
    name: str = ""
    function: Callable[[Any], object] | None = None

    @classmethod
    def of(cls, spec: KeySpec) -> KeySource:
        """Parse ``spec``, at decoration time, so that a typo fails at import.

        Raises:
            ImproperlyConfigured: An unknown prefix, an empty name, or
                neither a string nor a callable.
        """
        if spec is None:
            return cls()
        if callable(spec):
            return cls(kind="callable", function=spec)
        if not isinstance(spec, str):
            raise ImproperlyConfigured(
                f"idempotent(key={spec!r}) takes 'header:<Name>', 'body:<field>', "
                "'digest:body' or a callable."
            )
        prefix, _, name = spec.partition(":")
        name = name.strip()
        if prefix not in _PREFIXES or not name:
            raise ImproperlyConfigured(
                f"idempotent(key={spec!r}) is not a key source: write 'header:<Name>' "
                "(key='header:X-Event-Id'), 'body:<dotted.field>' (key='body:id'), "
                "'digest:body' (the SHA-256 of the raw body, for a signed webhook), "
                "or pass a callable taking the request."
            )
        if prefix == "body" and any(not part for part in name.split(".")):
            raise ImproperlyConfigured(f"idempotent(key={spec!r}) has an empty field name.")
        if prefix == "digest" and name not in _DIGESTS:
            raise ImproperlyConfigured(
                f"idempotent(key={spec!r}) is not a digest this package takes: write "
                "'digest:body', the SHA-256 of the request's raw body."
            )
        return cls(kind=cast("Literal['header', 'body', 'digest']", prefix), name=name)

    @property
    def reads_body(self) -> bool:
        """Whether the key is read out of the body, which must then be read first."""
        return self.kind in ("body", "digest")

    @property
    def header(self) -> str | None:
        """The header carrying the key, or None when it comes from the body or a callable."""
        if self.kind != "header":
            return None
        return self.name or idempotency_settings.HEADER

    @property
    def is_client_header(self) -> bool:
        """Whether the key is the ``IDEMPOTENCY["HEADER"]`` header a client sends.

        Such a key is echoed in the response, and the standard outcome
        policy applies; any other source is a webhook's (``outcomes``).
        """
        header = self.header
        return header is not None and header.lower() == idempotency_settings.HEADER.lower()

    def describe(self) -> str:
        """The source, as refusals name it."""
        if self.kind == "header":
            return f"the {self.header} header"
        if self.kind == "body":
            return f"the body field {self.name!r}"
        if self.kind == "digest":
            return "the body's digest"
        name = getattr(self.function, "__qualname__", repr(self.function))
        return f"the key returned by {name}()"

    def wanted(self) -> str:
        """What a request without a key lacks, as the 400 names it."""
        if self.is_client_header:
            return f"an {idempotency_settings.HEADER} header"
        if self.kind == "digest":
            return "a request body (its digest is the key)"
        return self.describe()

    def read(self, request: HttpRequest, max_length: int) -> str | None:
        """The request's key, or None when it has none.

        Raises:
            KeyInvalid: The value is not a key: empty, too long, not visible
                ASCII, or (from the body or a callable) not a string or an
                integer.
            NestedTooDeeply: The body the key is read from is nested too
                deeply to be parsed (the parser gave up with RecursionError).
        """
        if self.kind == "header":
            raw = request.headers.get(cast(str, self.header))
            if raw is None:
                return None
            if self.is_client_header:
                return parse_key(raw, max_length)
            value = raw.strip(" \t")
            if "," in value:
                # As for Idempotency-Key: a header sent twice arrives joined
                # with commas, and a comma cannot tell one key from two.
                raise KeyInvalid(f"{self._name()} holds a comma: send the header once.")
            return check_key(value, max_length, self._name())
        if self.kind == "digest":
            return _body_digest(request)
        found: object
        if self.kind == "body":
            found = _field(_parsed_body(request), self.name)
        else:
            found = cast(Callable[[Any], object], self.function)(request)
        if found is None or found is _ABSENT:
            return None
        # An integer id (1234) is the key "1234". A float, a boolean or a
        # structure is refused: 1 and 1.0 would be two keys for one id.
        if isinstance(found, int) and not isinstance(found, bool):
            found = str(found)
        if not isinstance(found, str):
            raise KeyInvalid(
                f"{self._name()} must be a string or an integer, not {type(found).__name__}."
            )
        return check_key(found, max_length, self._name())

    def _name(self) -> str:
        text = self.describe()
        return text[0].upper() + text[1:]


def _body_digest(request: HttpRequest) -> str | None:
    """The SHA-256 of the raw body, in hex (64 characters); None for an empty body.

    The raw bytes, as the sender signed them: not a parsed and re-serialised
    body, which would make two spellings of one payload two keys, and would
    stop being the bytes the signature covers.
    """
    try:
        raw = request.body  # a DRF Request hands this to Django's
    except RawPostDataException as exc:
        raise ImproperlyConfigured(
            "key='digest:body' needs the raw request body, but it was consumed as a stream "
            "before the key was read (request.POST or request.data of a multipart body). "
            "Read request.body first, as a signature check over the raw body does: in "
            "verify=, or in the DRF authentication class."
        ) from exc
    if not raw:
        return None  # names no event: a required key is missing
    return hashlib.sha256(raw).hexdigest()


def _parsed_body(request: HttpRequest) -> Any:
    """The body as a mapping: DRF's parsed data, else JSON or a form; None if unreadable.

    A body nested too deeply for the parser (its RecursionError, however
    shallow the key's own field) is refused as the fingerprint refuses it,
    whatever the key's source: a client error, never a 500.
    """
    try:
        return _parse(request)
    except RecursionError as exc:
        raise NestedTooDeeply() from exc


def _parse(request: HttpRequest) -> Any:
    if hasattr(request, "query_params"):  # a DRF Request: the view's own parsers
        return cast(Any, request).data
    content_type = request.content_type or ""
    if content_type == "application/json" or content_type.endswith("+json"):
        try:
            return json.loads(request.body)
        except ValueError:
            return None  # the view refuses it; it carries no readable key
    if request.method == "POST" and content_type in (
        "application/x-www-form-urlencoded",
        "multipart/form-data",
    ):
        # Cache the raw body first, so that the view (a signature check)
        # can still read request.body after the form is parsed.
        with contextlib.suppress(RawPostDataException, RequestDataTooBig):
            request.body  # noqa: B018
        return request.POST
    return None


def _field(data: Any, path: str) -> Any:
    node = data
    for part in path.split("."):
        if isinstance(node, MultiValueDict):
            values = node.getlist(part)
            if len(values) > 1:
                raise KeyInvalid(f"The body field {path!r} is sent more than once.")
            node = values[0] if values else _ABSENT
        elif isinstance(node, Mapping):
            node = node.get(part, _ABSENT)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _ABSENT
        if node is _ABSENT:
            return _ABSENT
    return node


_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")


def _is_visible_ascii(text: str) -> bool:
    return _VISIBLE_ASCII.fullmatch(text) is not None


def parse_key(raw: str, max_length: int) -> str:
    """Return the key carried by a header value, or raise ``KeyInvalid``.

    The IETF draft defines the header as a Structured Field String
    (``"..."``, RFC 8941/9651); most clients send the bare key. Both are
    accepted: a quoted value is unquoted by ``http_sf``, a bare one is taken
    as it is. Either way the key must be 1 to ``max_length`` visible ASCII
    characters other than the comma, which keeps it printable in logs and
    the admin and tells it from two header lines joined.
    """
    value = raw.strip(" \t")
    if "," in value:
        # Servers join a header sent twice with commas: the lines '"k1' and
        # 'k2"' arrive as '"k1, k2"', one valid quoted string. Quoted or not
        # (a quoted string spells a comma as it is), a comma cannot tell one
        # key from two.
        raise KeyInvalid(
            "The Idempotency-Key holds a comma, which a key may not contain: a server joins "
            "an Idempotency-Key header sent twice into one value with commas, so a comma "
            "cannot tell one key from two. Send the header once, with one key."
        )
    if value.startswith('"'):
        try:
            parsed, params = cast(
                "tuple[object, dict[str, object]]",
                http_sf.parse(value.encode("latin-1"), tltype="item"),
            )
        except (http_sf.StructuredFieldError, UnicodeEncodeError, ValueError) as exc:
            raise KeyInvalid(f"The quoted Idempotency-Key is malformed: {exc}.") from exc
        if not isinstance(parsed, str) or params:
            raise KeyInvalid("A quoted Idempotency-Key must be a plain string.")
        value = parsed
    if not value:
        raise KeyInvalid("The Idempotency-Key is empty.")  # a header, or the status view's key=
    return check_key(value, max_length, "The Idempotency-Key")


def check_key(value: str, max_length: int, name: str) -> str:
    """Return ``value`` if it is a key (1 to ``max_length`` visible ASCII characters).

    The rules every key obeys, wherever it comes from (``key_sources``);
    ``name`` names its source in the refusal ("The X-Delivery header").
    """
    if not value:
        raise KeyInvalid(f"{name} is empty.")
    if len(value) > max_length:
        raise KeyInvalid(f"{name} is longer than {max_length} characters.")
    if not _is_visible_ascii(value):
        raise KeyInvalid(
            f"{name} may contain only visible ASCII characters "
            "(no spaces, control characters or non-ASCII letters)."
        )
    return value
