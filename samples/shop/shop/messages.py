"""The messages the shop's services exchange: the contract between them.

Commands go to the one service that owns them (the routes in :mod:`shop.settings`); events
go to every service that handles them. The ``message_name`` is what travels on the wire:
keep it when you rename or move a class.
"""

from __future__ import annotations

from idembus import Command, Event


class PlaceOrder(Command, message_name="shop.PlaceOrder"):
    """The storefront asks the orders service to take an order."""

    order_id: str
    customer: str
    card_number: str
    amount_cents: int


class ChargePayment(Command, message_name="shop.ChargePayment"):
    """The orders service asks the payments service to charge a card."""

    order_id: str
    card_number: str
    amount_cents: int


class PaymentSucceeded(Event, message_name="shop.PaymentSucceeded"):
    order_id: str
    charge_id: str


class PaymentFailed(Event, message_name="shop.PaymentFailed"):
    order_id: str
    reason: str


class PaymentTimedOut(Command, message_name="shop.PaymentTimedOut"):
    """The orders saga's own timeout: no answer from payments in time."""

    order_id: str


class ShipOrder(Command, message_name="shop.ShipOrder"):
    """The orders service asks the shipping service to send the parcel."""

    order_id: str
    customer: str


class OrderShipped(Event, message_name="shop.OrderShipped"):
    order_id: str
    tracking_number: str


class OrderCompleted(Event, message_name="shop.OrderCompleted"):
    order_id: str


class OrderCancelled(Event, message_name="shop.OrderCancelled"):
    order_id: str
    reason: str
