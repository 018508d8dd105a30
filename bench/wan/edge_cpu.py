"""What each edge-side lever of the fast relay saves, per tensor, measured side by side in one process.

The relay benchmark (``bench/wan/relay.py``) measures the whole path, whose MB/s swing with the shared
machine's load; this one times the trainers' own per-tensor work on the same tensor, alternating the
variants so they share the load:

* sender: payload (``tensor_to_bytes`` copy, or the borrowed view) + CRC-32 (zlib, or ISA-L) + framing
  into chunks (``encode_chunk``, the one copy that remains);
* receiver: CRC-32 check + tensor (``tensor_from_bytes`` of bytes: a copy, or of the edge's bytearray:
  adopted).

    .venv/bin/python bench/wan/edge_cpu.py --size-mib 64 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import zlib
from collections.abc import Callable

import torch

from nebula_common.codec import checksum
from nebula_common.codec.base import tensor_bytes_view, tensor_from_bytes, tensor_to_bytes
from nebula_common.rpc.framing import chunk_size_for, encode_chunk

CHUNK = chunk_size_for(8 << 20)  # the default window's chunk size (1 MiB)


def frame_all(payload: bytes | memoryview) -> int:
    view = memoryview(payload)
    total = 0
    for offset in range(0, len(view), CHUNK):
        raw, _ = encode_chunk("job", "a->b", 0, 1, offset, view[offset : offset + CHUNK], False)
        total += len(raw)
    return total


def sender(crc: Callable[..., int], borrow: bool, tensor: torch.Tensor) -> None:
    payload = tensor_bytes_view(tensor) if borrow else tensor_to_bytes(tensor)
    crc(payload)
    frame_all(payload)


def receiver(crc: Callable[..., int], adopt: bool, buffer: bytearray, shape: tuple[int, ...]) -> None:
    crc(buffer)
    tensor_from_bytes(buffer if adopt else memoryview(buffer), torch.float32, shape)  # a view: copied


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from nebula_common.bulk_memory import keep_freed_memory_for_reuse

    keep_freed_memory_for_reuse()  # as the trainer does
    tensor = torch.randn(args.size_mib << 18)
    buffer = bytearray(tensor_to_bytes(tensor))
    shape = tuple(tensor.shape)
    variants: dict[str, Callable[[], None]] = {
        "sender: copy + zlib CRC + framing (before)": lambda: sender(zlib.crc32, False, tensor),
        "sender: copy + ISA-L CRC + framing": lambda: sender(checksum.crc32, False, tensor),
        "sender: view + ISA-L CRC + framing (now)": lambda: sender(checksum.crc32, True, tensor),
        "receiver: zlib CRC + copy (before)": lambda: receiver(zlib.crc32, False, bytearray(buffer), shape),
        "receiver: ISA-L CRC + copy": lambda: receiver(checksum.crc32, False, bytearray(buffer), shape),
        "receiver: ISA-L CRC + adopt (now)": lambda: receiver(checksum.crc32, True, bytearray(buffer), shape),
    }
    # The receiver variants include making their bytearray (the edge's assembly, 1 copy): the same for all.
    times: dict[str, list[float]] = {name: [] for name in variants}
    for run in variants.values():
        run()  # warm-up
    for _ in range(args.rounds):
        for name, run in variants.items():
            start = time.process_time()
            run()
            times[name].append(time.process_time() - start)
    result = {
        "command": f".venv/bin/python bench/wan/edge_cpu.py --size-mib {args.size_mib} "
        f"--rounds {args.rounds}",
        "crc32": checksum.IMPLEMENTATION,
        "load": os.getloadavg(),
        "cpu_ms_per_tensor_median": {name: round(statistics.median(t) * 1e3, 1) for name, t in times.items()},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
