"""Test doubles and harnesses shipped with topicd (used by tests/ and bench/)."""
