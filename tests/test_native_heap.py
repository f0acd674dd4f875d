"""glibc keeps a step's freed activations for the next step (glmserve/native_heap.py): after
`reuse_freed_memory` a 20 MB tensor allocated again after its free takes no new page faults."""

from __future__ import annotations

import platform
import resource

import pytest
import torch

from glmserve import native_heap


def faults_of_fresh_tensor(mb: int) -> int:
    """Minor page faults of allocating and writing a `mb` MB tensor."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(mb << 18)  # float32: 4 bytes each
    x.fill_(1.0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del x
    return faults


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_activations_are_reused_without_faults():
    native_heap.reuse_freed_memory.cache_clear()
    assert native_heap.reuse_freed_memory()
    faults_of_fresh_tensor(20)  # the heap grows once
    assert faults_of_fresh_tensor(20) < 100  # 20 MB in fresh pages would be ~5,000 faults


def test_env_turns_it_off(monkeypatch):
    monkeypatch.setenv(native_heap.HEAP_REUSE_ENV, "0")
    native_heap.reuse_freed_memory.cache_clear()
    try:
        assert native_heap.reuse_freed_memory() is False
    finally:
        native_heap.reuse_freed_memory.cache_clear()
