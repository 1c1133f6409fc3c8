"""The URLconf of the Ninja API the middleware protects (tests/test_ninja_middleware.py)."""

from django.urls import path

from tests.testapp.ninja_middleware_api import api

urlpatterns = [path("ninja-mw/", api.urls)]
