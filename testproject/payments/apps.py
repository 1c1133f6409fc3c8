from django.apps import AppConfig


class PaymentsConfig(AppConfig):
    name = "payments"
    default_auto_field = "django.db.models.BigAutoField"
    verbose_name = "Payments"

    def ready(self) -> None:
        # Registers the reconciler of "POST v1/payments": every process that
        # runs recovery (a Celery worker, manage.py idempotency_recover)
        # loads the apps, and so knows it.
        from payments import crash_hooks, reconcilers  # noqa: F401

        if crash_hooks.enabled():
            crash_hooks.install()
