"""`python -m ablate ...` is the same CLI as the `ablate` script (and what `ray job submit` runs)."""

from ablate.cli import entry

entry()
