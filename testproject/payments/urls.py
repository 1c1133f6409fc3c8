from rest_framework.routers import SimpleRouter

from payments.views import PaymentViewSet

# No trailing slashes (/v1/payments, /v1/payments/7/refunds) and path
# converters instead of regexes, so route patterns read like Django's own.
router = SimpleRouter(trailing_slash=False, use_regex_path=False)
router.register("payments", PaymentViewSet, basename="payment")

urlpatterns = router.urls
