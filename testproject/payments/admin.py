from django.contrib import admin

from payments.models import Payment, Refund


# Unparametrised: Django's admin classes are not subscriptable at run time.
class RefundInline(admin.TabularInline):  # type: ignore[type-arg]
    model = Refund
    extra = 0
    readonly_fields = ["amount", "created_at"]
    can_delete = False


@admin.register(Payment)
class PaymentAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = [
        "id",
        "owner",
        "order_id",
        "amount",
        "currency",
        "status",
        "provider_charge_id",
        "created_at",
    ]
    list_filter = ["status", "currency", "owner"]
    search_fields = ["order_id", "provider_charge_id"]
    readonly_fields = ["provider_charge_id", "created_at"]
    inlines = [RefundInline]


@admin.register(Refund)
class RefundAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["id", "payment", "amount", "created_at"]
    readonly_fields = ["created_at"]
