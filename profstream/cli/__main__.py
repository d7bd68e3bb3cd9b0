"""`python -m profstream.cli ...`: the same as the `profstream` command."""

from profstream.cli import main

main()
