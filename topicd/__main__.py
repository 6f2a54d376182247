"""`python -m topicd` runs the command line (same as the `topicd` console script)."""

from topicd.cli import main

raise SystemExit(main())
