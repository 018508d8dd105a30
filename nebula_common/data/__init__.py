"""Trainer-side access to datasets served by a cluster's data service (``nebula-data``)."""

from nebula_common.data.batches import GrantedBatchSource

__all__ = ["GrantedBatchSource"]
