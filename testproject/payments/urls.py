from django.urls import path
from rest_framework.routers import SimpleRouter

from payments.github_webhooks import github_webhook
from payments.stripe_webhooks import StripeWebhookView
from payments.two_step import two_step_payment
from payments.views import PaymentViewSet

# No trailing slashes (/v1/payments, /v1/payments/7/refunds) and path
# converters instead of regexes, so route patterns read like Django's own.
router = SimpleRouter(trailing_slash=False, use_regex_path=False)
router.register("payments", PaymentViewSet, basename="payment")

urlpatterns = [
    # Authorize, then capture: two external calls (steps) in one operation.
    path("payments/two-step", two_step_payment, name="payment-two-step"),
    *router.urls,
    path("webhooks/stripe", StripeWebhookView.as_view()),
    path("webhooks/github", github_webhook),
]
