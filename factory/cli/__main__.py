"""`python -m factory.cli`: `qf`."""

from factory.cli import main

main()
