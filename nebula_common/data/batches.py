"""Batches of another account's dataset, fetched through the interface its owner's cluster serves.

A stage that trains on data it was *granted* never holds the dataset: it asks the data service for
the records of each micro-batch by example id (the same ids ``nebula_common.jobspec.runtime
.example_ids`` yields in every cluster), and the service re-checks the grant on every call. So the
owner's ``nebula data revoke`` stops the very next batch, with ``DatasetNotFoundError``, and the
data service's audit log shows every batch that was read, by whom.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

from nebula_common.clients.data import DataClient, DatasetInfo, parse_dataset_ref
from nebula_common.errors import InvalidRequestError


class GrantedBatchSource:
    """``GrantedBatchSource(address, token, "owner/name").batch(ids)`` -> the records, parsed JSON.

    ``token`` is the bearer token of the account the stage runs for (the trainer already holds the
    submitter's token for its switch edges). The first call checks the dataset is visible and learns
    its size, so a missing grant fails the stage at start-up rather than mid-step.
    """

    def __init__(
        self, address: str, token: str | Callable[[], str], dataset: str, *, timeout: float = 30.0
    ) -> None:
        owner, _ = parse_dataset_ref(dataset)
        if not owner:
            raise InvalidRequestError(f"dataset {dataset!r} must name its owner: OWNER/NAME")
        self.dataset = dataset
        self._client = DataClient(address, token, timeout=timeout)
        self._info: DatasetInfo | None = None

    def info(self) -> DatasetInfo:
        """The dataset's size and digest as its owner's service reports it (cached after the first call)."""
        if self._info is None:
            owned, granted = self._client.list()  # owners may read their own dataset the same way
            match = [d for d in [*owned, *granted] if d.ref == self.dataset]
            if not match:
                # Ask ReadBatch for record 0: it raises the service's own refusal (NOT_FOUND) verbatim.
                self._client.read_batch_json(self.dataset, [0])
                raise InvalidRequestError(f"dataset {self.dataset} is neither yours nor granted to you")
            self._info = match[0]
        return self._info

    def __len__(self) -> int:
        return self.info().records

    def batch(self, example_ids: Sequence[int]) -> list[Any]:
        """The records of ``example_ids``, in that order; raises if the grant is gone."""
        if not example_ids:
            return []
        return self._client.read_batch(self.dataset, example_ids)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> GrantedBatchSource:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
