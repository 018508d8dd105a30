"""Freed tensor memory is reused without faulting fresh pages (nebula_common/bulk_memory.py).

Each case runs in a fresh interpreter: mallopt settings are process-wide.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = """
import json, resource
from nebula_common.bulk_memory import keep_freed_memory_for_reuse
applied = keep_freed_memory_for_reuse()
size = 64 << 20
buffer = bytearray(size)  # the first tensor: its pages fault once either way
del buffer
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):  # eight more 64 MiB tensors, each written in full, as a receiver assembles them
    buffer = bytearray(size)
    del buffer
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"applied": applied, "faults": faults}))
"""


def _run(keep: str) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NEBULA_MALLOC_KEEP_FREED": keep}
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(out.stdout)  # type: ignore[no-any-return]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_large_buffers_reuse_mapped_pages_unless_turned_off() -> None:
    kept, default = _run("1"), _run("0")
    assert kept["applied"] is True and default["applied"] is False
    pages = 8 * (64 << 20) // 4096  # what eight fresh 64 MiB buffers fault (4 KiB pages)
    assert default["faults"] >= pages // 2, default  # glibc's default: fresh mmap pages each time
    assert kept["faults"] < pages // 10, kept  # kept: the same pages, already mapped


ENTRY = """
import json, resource, sys
import {module} as entry
entry.run_service_main = lambda *args: 0  # only the entry point's own setup, no service
entry.main()
buffer = bytearray(64 << 20)
del buffer
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    buffer = bytearray(64 << 20)
    del buffer
print(json.dumps({{"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize("module", ["services.switch.__main__", "services.trainer.__main__"])
def test_the_switch_and_trainer_entry_points_keep_freed_memory(module: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("NEBULA_MALLOC_KEEP_FREED", None)
    out = subprocess.run(
        [sys.executable, "-c", ENTRY.format(module=module)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert json.loads(out.stdout)["faults"] < 8 * (64 << 20) // 4096 // 10


THREAD = """
import json, resource, threading
from nebula_common.bulk_memory import keep_freed_memory_for_reuse, uninitialized_bytearray
keep_freed_memory_for_reuse()
size = 64 << 20
found = {}

def assemble():  # as the receiving edge's loop thread assembles tensors: not the main thread
    buffer = uninitialized_bytearray(size)
    memoryview(buffer)[:] = bytes(size)
    del buffer
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for index in range(8):
        buffer = uninitialized_bytearray(size)
        memoryview(buffer)[::4096] = bytes([index]) * (size // 4096)  # one write per page
        del buffer
    found["faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

thread = threading.Thread(target=assemble)
thread.start()
thread.join()
print(json.dumps(found))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_large_buffers_of_another_thread_reuse_mapped_pages_unless_turned_off() -> None:
    def run(keep: str) -> int:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "NEBULA_MALLOC_KEEP_FREED": keep}
        out = subprocess.run(
            [sys.executable, "-c", THREAD], env=env, capture_output=True, text=True, timeout=60, check=True
        )
        return int(json.loads(out.stdout)["faults"])

    pages = 8 * (64 << 20) // 4096
    assert run("0") >= pages // 2  # a thread's arena: a fresh mmap for each 64 MiB buffer
    assert run("1") < pages // 10  # one arena: the main heap's pages, already mapped


def test_an_uninitialized_bytearray_is_a_writable_bytearray_a_decoder_adopts() -> None:
    import torch

    from nebula_common.bulk_memory import uninitialized_bytearray
    from nebula_common.codec.base import tensor_from_bytes

    buffer = uninitialized_bytearray(4096)
    assert type(buffer) is bytearray and len(buffer) == 4096
    values = torch.arange(1024, dtype=torch.float32)
    memoryview(buffer)[:] = values.numpy().tobytes()
    tensor = tensor_from_bytes(buffer, torch.float32, (32, 32))
    assert torch.equal(tensor.reshape(-1), values)
    buffer[0:4] = b"\0\0\x80\x3f"  # 1.0: adopted, not copied, so the tensor sees the buffer's bytes
    assert tensor[0, 0].item() == 1.0
    assert uninitialized_bytearray(0) == bytearray()
    with pytest.raises(ValueError, match="-1 bytes"):
        uninitialized_bytearray(-1)
