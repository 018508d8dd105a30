"""``nebula-signer``: the audit signer, the one process that holds a cluster's audit seal keys."""
