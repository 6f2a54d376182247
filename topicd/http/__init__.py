"""The HTTP surface: the Quart-Trio app, its routes and the ASGI gate in front of them."""
