"""glibc keeps a step's freed activations for the next step (glmserve/native_heap.py): after
`reuse_freed_memory`, steps that each allocate and free 120 MB of tensors stop taking page faults (with glibc's
own thresholds, 45,984 faults over the last six of twelve such steps here: its trim threshold gives the freed top
of the heap back)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from glmserve import native_heap

STEPS = """
import resource, torch
from glmserve import native_heap
native_heap.reuse_freed_memory()
def step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    held = []
    for _ in range(6):  # six 20 MB float32 activations, freed at the step's end
        x = torch.empty(20 << 18)
        x.fill_(1.0)
        held.append(x)
    del held
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(sum([step() for _ in range(12)][6:]))
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_steps_reuse_freed_memory_without_faults():
    # a fresh process: its heap holds nothing but these steps
    run = subprocess.run([sys.executable, "-c", STEPS], capture_output=True, text=True, timeout=120, check=True)
    assert int(run.stdout.split()[-1]) < 100  # 120 MB in fresh pages would be ~30,000 faults a step


def test_env_turns_it_off(monkeypatch):
    monkeypatch.setenv(native_heap.HEAP_REUSE_ENV, "0")
    native_heap.reuse_freed_memory.cache_clear()
    try:
        assert native_heap.reuse_freed_memory() is False
    finally:
        native_heap.reuse_freed_memory.cache_clear()
