from adrf.routers import SimpleRouter as AsyncRouter
from django.contrib import admin
from django.urls import include, path
from rest_framework.routers import DefaultRouter

from django_idempotency.prometheus import metrics_view
from tests.testapp import (
    adrf_views,
    keyed_views,
    optimistic_duplicate_views,
    optimistic_live_views,
    optimistic_views,
    parsed_upload_views,
    views,
)

router = DefaultRouter()
router.register("viewset/charges", views.ChargeViewSet, basename="viewset-charge")

# adrf's router binds an async viewset's actions to its "a"-named handlers (acreate, ...).
async_router = AsyncRouter()
async_router.register("adrf/viewset", adrf_views.MixinModelViewSet, basename="adrf-viewset")
async_router.register("adrf/decorated-viewset", adrf_views.DecoratedViewSet, basename="adrf-deco")

urlpatterns = [
    path("admin/", admin.site.urls),
    path("metrics", metrics_view),
    path("api-view/charges", views.api_view_charges),
    path("api-view/fields", views.api_view_selected_fields),
    path("api-view/optional", views.api_view_optional_key),
    path("api-view/by-ref/<uuid:ref>", views.api_view_charge_for_reference),
    path("cbv/charges", views.ChargeAPIView.as_view()),
    path("cbv/charges/<int:pk>", views.ChargeDetailAPIView.as_view()),
    path("cbv/own-dispatch", views.OwnDispatchView.as_view()),
    path("generic/charges", views.ChargeGenericView.as_view()),
    path("mixin/charges", views.MixinChargeView.as_view()),
    path("mixin/selected", views.MixinSelectedInputView.as_view()),
    path("plain/charges", views.plain_django_charges),
    path("async/charges", views.async_plain_charges),
    path("plain/form-charges", views.plain_form_charges),
    path("probe", views.TransactionProbeView.as_view()),
    path("cbv/durable", views.DurableBlockView.as_view()),
    path("api-view/external", views.api_view_external_call),
    path("api-view/steps", views.api_view_steps),
    path("api-view/provider-charge", views.api_view_provider_charge),
    path("api-view/unprotected", views.api_view_unprotected),
    path("api-view/optimistic", optimistic_views.api_view_optimistic),
    path("mixin/optimistic", optimistic_views.OptimisticMixinView.as_view()),
    path("api-view/probe", views.api_view_probe),
    path("api-view/probe-exempt", views.api_view_probe_exempt),
    path("optimistic/orders", optimistic_live_views.optimistic_orders),
    path("optimistic/orders-default", optimistic_live_views.default_mode_orders),
    path("optimistic/notes", optimistic_live_views.optimistic_notes),
    path("idempotency/", include("django_idempotency.urls")),
    path("keyed/delivery-header", keyed_views.delivery_header),
    path("keyed/body-field", keyed_views.body_field),
    path("keyed/body-digest", keyed_views.body_digest),
    path("parsed/upload", parsed_upload_views.parsed_upload),
    path("keyed/body-field-standard", keyed_views.body_field_standard_policy),
    path("keyed/plain-callable", keyed_views.plain_callable_key),
    path("keyed/plain-body", keyed_views.plain_body_field),
    path("keyed/verified", keyed_views.verified_delivery),
    path("keyed/mixin", keyed_views.MixinBodyKeyView.as_view()),
    path("policy/by-status", keyed_views.policy_view),
    path("optimistic-duplicates/lock-account", optimistic_duplicate_views.lock_account_optimistic),
    path(
        "optimistic-duplicates/lock-account-default",
        optimistic_duplicate_views.lock_account_default,
    ),
    path("optimistic-duplicates/two-rows", optimistic_duplicate_views.two_rows),
    path("optimistic-duplicates/two-rows-uncertain", optimistic_duplicate_views.two_rows_uncertain),
    path(
        "optimistic-duplicates/uncertain", optimistic_duplicate_views.uncertain_on_a_database_error
    ),
    path("optimistic-duplicates/get-or-create", optimistic_duplicate_views.get_or_create_order),
    path("optimistic-duplicates/own-error", optimistic_duplicate_views.caught_then_own_error),
    path("optimistic-duplicates/async", optimistic_duplicate_views.async_charge),
    path(
        "optimistic-duplicates/shared-optimistic",
        optimistic_duplicate_views.shared_operation_optimistic,
    ),
    path(
        "optimistic-duplicates/shared-default", optimistic_duplicate_views.shared_operation_default
    ),
    path("optimistic-duplicates/second-alias", optimistic_duplicate_views.writes_to_a_second_alias),
    path("optimistic-duplicates/loses-connection", optimistic_duplicate_views.loses_its_connection),
    path("adrf/mixin", adrf_views.MixinAPIView.as_view()),
    path("adrf/decorated", adrf_views.DecoratedAPIView.as_view()),
    path("adrf/function", adrf_views.function_view),
    path("adrf/generic", adrf_views.MixinGenericView.as_view()),
    path("adrf/authenticated-mixin", adrf_views.AuthenticatedMixinView.as_view()),
    path("adrf/authenticated-decorated", adrf_views.AuthenticatedDecoratedView.as_view()),
    path("adrf/first-charge-mixin", adrf_views.FirstChargeMixinView.as_view()),
    path("adrf/first-charge-decorated", adrf_views.FirstChargeDecoratedView.as_view()),
    path("", include(async_router.urls)),
    path("", include(router.urls)),
]
