"""The URLconf of the Django Ninja test APIs (tests/test_ninja.py): theirs alone."""

from django.urls import path

from django_idempotency.ninja import non_atomic_requests
from tests.testapp.ninja_api import api, transactions_api

urlpatterns = [
    path("ninja/", api.urls),
    path("ninja-transactions/", non_atomic_requests(transactions_api.urls)),
]
