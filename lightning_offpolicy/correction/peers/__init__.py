"""One module per peer: each turns that peer's setting names into the kit's settings (a
:class:`~lightning_offpolicy.correction.peers.common.Translation`)."""
