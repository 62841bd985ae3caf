"""`python -m lmhead.cli`: the `lmhead` command."""

from lmhead.cli import entry

entry()
