"""DRF views whose parsers deliver values that are neither JSON nor Django's uploads.

Weblate's upload parser, for one, puts a file sent without a filename into
``request.FILES`` as a ``ContentFile``; an XML or YAML parser delivers
dates. Each view writes a Charge per run.
"""

from __future__ import annotations

import datetime
import uuid
from typing import IO, Any

from django.core.files.base import ContentFile
from django.http import QueryDict
from django.utils.datastructures import MultiValueDict
from rest_framework.decorators import api_view, parser_classes
from rest_framework.parsers import BaseParser, DataAndFiles
from rest_framework.request import Request
from rest_framework.response import Response

from django_idempotency import idempotent
from tests.testapp.models import Charge


class UnnamedFileParser(BaseParser):
    """The raw body as an unnamed ``ContentFile`` in ``request.FILES``, as Weblate's does."""

    media_type = "application/octet-stream"

    def parse(
        self, stream: IO[Any], media_type: str | None = None, parser_context: Any = None
    ) -> DataAndFiles[Any, Any]:
        files = MultiValueDict({"file": [ContentFile(stream.read())]})
        return DataAndFiles(QueryDict(mutable=True), files)


class DatedParser(BaseParser):
    """A date, a time of day, an instant and a UUID, as YAML or XML parsers deliver them."""

    media_type = "application/x-dated"

    def parse(
        self, stream: IO[Any], media_type: str | None = None, parser_context: Any = None
    ) -> dict[str, Any]:
        day, at, ref = stream.read().decode().split()
        moment = datetime.datetime.fromisoformat(f"{day}T{at}")
        return {
            "day": moment.date(),
            "at": moment.timetz(),
            "moment": moment,
            "ref": uuid.UUID(ref),
        }


class Opaque:
    """A parser's own type, with no canonical form."""


class OpaqueParser(BaseParser):
    media_type = "application/x-opaque"

    def parse(
        self, stream: IO[Any], media_type: str | None = None, parser_context: Any = None
    ) -> dict[str, Any]:
        return {"thing": Opaque()}


@api_view(["POST"])
@parser_classes([UnnamedFileParser, DatedParser, OpaqueParser])
@idempotent(operation="parsed-upload")
def parsed_upload(request: Request) -> Response:
    upload = request.FILES.get("file")
    content = upload.read() if upload is not None else b""
    charge = Charge.objects.create(tenant="parsed", amount=len(content), note=content[:50].hex())
    return Response({"id": charge.pk, "size": len(content)}, status=201)
