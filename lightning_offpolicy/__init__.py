"""lightning_offpolicy."""
