"""topicd: a persistent event engine on Trio.

Topics are append-only logs of JSON records reached over HTTP (`/v0`, wire-compatible with
the `topics` engine). See `docs/README.md` for the operator documentation.
"""

__version__ = "0.1.0"
