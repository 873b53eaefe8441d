"""The local shop: a generated catalog, its web app and the `web/shop-v0` env."""
