"""``nebula-data``: each account's datasets in its own namespace, and access to them through the owner."""
