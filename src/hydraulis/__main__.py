"""`python -m hydraulis ...` (and `torchrun ... -m hydraulis train ...`): the `hydraulis` command."""

from hydraulis.cli import main

main()
