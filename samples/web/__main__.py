"""Serve the ordering sample over HTTP on memory:// and MemoryStorage:

    python -m samples.web [--port 8000]
    curl -X POST localhost:8000/orders -H 'Idempotency-Key: k1' \
         -H 'content-type: application/json' \
         -d '{"order_id": "o-1", "customer": "ann", "amount_cents": 1200}'
"""

from __future__ import annotations

import argparse

import uvicorn

from samples.ordering.system import build
from samples.web.app import create_app


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m samples.web", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(create_app(build()), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
