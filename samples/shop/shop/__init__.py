"""The idembus tutorial's shop: an ``orders`` saga, ``payments`` and ``shipping``, each run
as its own service (``idembus run shop.orders:make_endpoint --workers 2``), and a
``storefront`` web app that takes orders over HTTP (``uvicorn shop.storefront:create_app
--factory``)."""
