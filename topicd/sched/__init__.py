"""Delivery scheduling: effective priority (and, later, the banded DWRR and the governor)."""
