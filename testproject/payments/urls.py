from django.urls import path
from rest_framework.routers import SimpleRouter

from payments.github_webhooks import github_webhook
from payments.stripe_webhooks import StripeWebhookView
from payments.views import PaymentViewSet

# No trailing slashes (/v1/payments, /v1/payments/7/refunds) and path
# converters instead of regexes, so route patterns read like Django's own.
router = SimpleRouter(trailing_slash=False, use_regex_path=False)
router.register("payments", PaymentViewSet, basename="payment")

urlpatterns = [
    *router.urls,
    path("webhooks/stripe", StripeWebhookView.as_view()),
    path("webhooks/github", github_webhook),
]
