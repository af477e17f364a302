"""`python -m pipeline`: the command-line entry point."""

from pipeline.cli import main

raise SystemExit(main())
