"""The demo checkpoints: tiny models built from a config and warmed up by SFT (``tiny:`` names), which
the quickstart, the examples and the tests train, and the self-check that runs every correction preset on
one (``lightning-offpolicy selfcheck``). The core imports this package only lazily: for ``tiny:`` names and
for the ``selfcheck`` subcommand."""
