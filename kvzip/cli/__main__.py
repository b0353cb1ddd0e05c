"""`python -m kvzip.cli` runs the kvzip command (what the console script calls)."""

from kvzip.cli import main

main()
