from __future__ import annotations

from django.contrib import admin
from django.urls import path

from tests.testapp import shard_views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("shard/charges", shard_views.charge_in_the_shard),
    path("shard/misrouted", shard_views.charge_where_the_router_says),
]
