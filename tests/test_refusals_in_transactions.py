"""A refusal never poisons a transaction it did not open.

DRF's exception handler marks the open atomic block of every
ATOMIC_REQUESTS database for rollback. In a test (TestCase, pytest-django's
``django_db``) or under a caller's ``atomic()``, that block is the caller's:
after a 400 or 422 the caller's next query raised TransactionManagementError.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import connections, transaction
from django.test import TestCase
from rest_framework.test import APIClient

from django_idempotency.testing import assert_protected
from tests.testapp.models import Charge
from tests.utils import post

URLS = ["/api-view/charges", "/cbv/charges", "/viewset/charges/", "/plain/charges"]


@pytest.fixture
def atomic_requests_on() -> Iterator[None]:
    settings_dict = connections["default"].settings_dict
    settings_dict["ATOMIC_REQUESTS"] = True
    yield
    settings_dict["ATOMIC_REQUESTS"] = False


@pytest.mark.django_db
@pytest.mark.parametrize("url", URLS)
def test_the_documented_pytest_django_test_passes_under_atomic_requests(
    atomic_requests_on: None, url: str
) -> None:
    assert_protected(APIClient(), url, {"amount": 1})
    assert Charge.objects.count() == 1  # the test's transaction is still usable


@pytest.mark.django_db
def test_refusals_leave_a_callers_atomic_block_usable(atomic_requests_on: None) -> None:
    api = APIClient()
    with transaction.atomic():
        # A class-based view: exempt from ATOMIC_REQUESTS, so no savepoint of
        # Django's stands between DRF's handler and the caller's block.
        assert post(api, "/cbv/charges", {"amount": 1}, None).status_code == 400
        assert post(api, "/cbv/charges", {"amount": 1}, "k").status_code == 201
        assert post(api, "/cbv/charges", {"amount": 2}, "k").status_code == 422
        assert not transaction.get_rollback()
        assert Charge.objects.count() == 1


class AssertProtectedInATestCase(TestCase):
    def setUp(self) -> None:
        connections["default"].settings_dict["ATOMIC_REQUESTS"] = True

    def tearDown(self) -> None:
        connections["default"].settings_dict["ATOMIC_REQUESTS"] = False

    def test_assert_protected_under_atomic_requests(self) -> None:
        assert_protected(APIClient(), "/cbv/charges", {"amount": 1})
        assert Charge.objects.count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("method", "url", "refused"),
    [
        # Refused by DRF before the claim: a bad token (401), an unknown method (405).
        ("post", "/api-view/unprotected", 401),  # not protected at all: the reference
        ("post", "/cbv/charges", 401),
        ("post", "/viewset/charges/", 401),
        ("delete", "/cbv/charges/1", 401),
        ("get", "/cbv/charges", 405),  # a handler the view does not protect
    ],
)
def test_a_refusal_before_the_claim_leaves_the_tests_transaction_usable(
    atomic_requests_on: None, method: str, url: str, refused: int
) -> None:
    """As the same view unprotected does: there Django's savepoint takes DRF's mark."""
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION="Token not-a-token")
    if refused == 405:
        api.credentials()
    headers = {"HTTP_IDEMPOTENCY_KEY": "k"} if method != "get" else {}

    response = getattr(api, method)(url, {"amount": 1}, format="json", **headers)

    assert response.status_code == refused
    assert Charge.objects.count() == 0  # no TransactionManagementError
    assert not transaction.get_rollback()
