"""The payments service: charges a card for each ``ChargePayment``.

    idembus run shop.payments:make_endpoint --workers 2
"""

from __future__ import annotations

from idembus import Endpoint, RetryPolicy
from idembus.handlers import Handler, handles

from . import settings
from .messages import ChargePayment, PaymentFailed, PaymentSucceeded
from .provider import CardBlocked, CardDeclined, FakePaymentProvider


class PaymentHandler(Handler):
    """Charges the card through the provider and says how it went."""

    # A blocked card stays blocked however often we ask: straight to the error queue,
    # where a person finds it (idembus errors list), gets the card approved and retries it.
    retry_policy = RetryPolicy(immediate_retries=3, delayed=(2.0, 5.0),
                               unrecoverable=(*RetryPolicy().unrecoverable, CardBlocked))

    def __init__(self, provider: FakePaymentProvider) -> None:
        self.provider = provider

    @handles
    def charge(self, message: ChargePayment) -> None:
        try:
            charge = self.provider.charge(
                message.card_number, message.amount_cents,
                description=f"order {message.order_id}",
                # The same for every attempt at this message, in any worker: a charge made
                # before a crash is returned, not made again, when the message comes back.
                idempotency_key=self.context.idempotency_key,
            )
        except CardDeclined as declined:
            self.bus.publish(PaymentFailed(order_id=message.order_id, reason=str(declined)))
            return
        self.bus.publish(PaymentSucceeded(order_id=message.order_id,
                                          charge_id=charge.charge_id))


def make_endpoint() -> Endpoint:
    """The payments service, configured from the environment (:mod:`shop.settings`)."""
    return Endpoint(
        "payments",
        transport=settings.broker_url(),
        storage=settings.storage("payments"),
        handlers=[PaymentHandler(FakePaymentProvider())],
        error_queue=settings.ERROR_QUEUE,
    )
