"""The demo checkpoints: tiny models built from a config and warmed up by SFT (``tiny:`` names), which
the quickstart, the examples and the tests train. The core imports this package only for ``tiny:`` names."""
