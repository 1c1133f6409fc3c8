from django.contrib import admin
from django.urls import include, path
from rest_framework.routers import DefaultRouter

from tests.testapp import keyed_views, optimistic_views, views

router = DefaultRouter()
router.register("viewset/charges", views.ChargeViewSet, basename="viewset-charge")

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api-view/charges", views.api_view_charges),
    path("api-view/fields", views.api_view_selected_fields),
    path("api-view/optional", views.api_view_optional_key),
    path("api-view/by-ref/<uuid:ref>", views.api_view_charge_for_reference),
    path("cbv/charges", views.ChargeAPIView.as_view()),
    path("cbv/single", views.SingleTransactionChargeView.as_view()),
    path("cbv/charges/<int:pk>", views.ChargeDetailAPIView.as_view()),
    path("cbv/own-dispatch", views.OwnDispatchView.as_view()),
    path("generic/charges", views.ChargeGenericView.as_view()),
    path("mixin/charges", views.MixinChargeView.as_view()),
    path("mixin/selected", views.MixinSelectedInputView.as_view()),
    path("plain/charges", views.plain_django_charges),
    path("async/charges", views.async_plain_charges),
    path("plain/form-charges", views.plain_form_charges),
    path("probe", views.TransactionProbeView.as_view()),
    path("api-view/external", views.api_view_external_call),
    path("api-view/steps", views.api_view_steps),
    path("api-view/unprotected", views.api_view_unprotected),
    path("api-view/single", views.api_view_single_transaction),
    path("api-view/optimistic", optimistic_views.api_view_optimistic),
    path("mixin/optimistic", optimistic_views.OptimisticMixinView.as_view()),
    path("api-view/probe", views.api_view_probe),
    path("api-view/probe-exempt", views.api_view_probe_exempt),
    path("idempotency/", include("django_idempotency.urls")),
    path("keyed/delivery-header", keyed_views.delivery_header),
    path("keyed/body-field", keyed_views.body_field),
    path("keyed/body-field-standard", keyed_views.body_field_standard_policy),
    path("keyed/plain-callable", keyed_views.plain_callable_key),
    path("keyed/plain-body", keyed_views.plain_body_field),
    path("keyed/verified", keyed_views.verified_delivery),
    path("keyed/mixin", keyed_views.MixinBodyKeyView.as_view()),
    path("policy/by-status", keyed_views.policy_view),
    path("policy/single", keyed_views.policy_single_view),
    path("", include(router.urls)),
]
