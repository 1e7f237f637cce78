"""Place orders through the storefront and wait for their outcome:

    python -m shop.place_orders --count 200 [--url http://127.0.0.1:8000] [--card NUMBER]

It prints how the orders ended and, from the fake provider (``SHOP_PROVIDER_DB``), how many
times each was charged: once each, whatever crashed meanwhile.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from collections.abc import Sequence

import httpx

from .provider import FakePaymentProvider

ENDED = ("completed", "cancelled")


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status 0 if every order ended and none was charged twice."""
    parser = argparse.ArgumentParser(prog="python -m shop.place_orders")
    parser.add_argument("--count", type=int, default=20, help="orders to place (20)")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the storefront")
    parser.add_argument("--card", default="4242424242424242", help="the card to pay with")
    parser.add_argument("--wait", type=float, default=60.0,
                        help="seconds to wait for the orders to end (60)")
    args = parser.parse_args(argv)
    with httpx.Client(base_url=args.url, timeout=10) as client:
        orders = []
        for number in range(args.count):
            answer = client.post("/orders", json={
                "customer": f"customer-{number}", "card_number": args.card,
                "amount_cents": 1000 + number})
            answer.raise_for_status()
            orders.append(answer.json()["order_id"])
        print(f"placed {len(orders)} orders; waiting for them to end...")
        deadline = time.monotonic() + args.wait
        statuses: dict[str, str] = {}
        while True:
            for order_id in orders:
                if statuses.get(order_id) not in ENDED:
                    statuses[order_id] = client.get(f"/orders/{order_id}").json()["status"]
            if all(status in ENDED for status in statuses.values()):
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
    ended = collections.Counter(statuses.values())
    print("orders: " + ", ".join(f"{count} {status}" for status, count in sorted(ended.items())))
    charged = collections.Counter(charge.description for charge in FakePaymentProvider().charges())
    times = collections.Counter(charged[f"order {order_id}"] for order_id in orders)
    print(f"charged: {times[1]} once, {sum(n for k, n in times.items() if k > 1)} more than "
          f"once, {times[0]} not at all")
    return 0 if set(ended) <= set(ENDED) and not any(k > 1 for k in times) else 1


if __name__ == "__main__":
    sys.exit(main())
