"""The workers' two rules for glibc's malloc (zero/host_memory.py), in a process of their own
(mallopt is process-wide). Oracle: the kernel's count of page faults. Memory given back to the
system comes back as fresh pages (a fault per 4 KiB) when allocated again; memory kept in the
heap is reused without one."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

ROUNDS, PAGES = 10, 2048  # 8 MB tensors, allocated, written and freed in turn; 4 KiB pages each

# Counted over ten after ten more: in the heap, a freed block followed by a small allocation of
# Python's or torch's is too small for the next aligned request of the same size, so the heap grows
# for the first few (up to five seen here, varying with the process's address layout) before its
# blocks fit
_PROBE = rf"""
import resource, torch
from elastic_zero.zero import host_memory

def faults_of_8mb_tensors():
    for _ in range({ROUNDS}):
        torch.ones(2 << 20)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range({ROUNDS}):
        torch.ones(2 << 20)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

host_memory.large_allocations_to_the_system()
given_back = faults_of_8mb_tensors()
host_memory.release_free_memory()
host_memory.step_allocations_in_the_heap()
kept = faults_of_8mb_tensors()
print(given_back, kept)
"""


def test_building_gives_large_blocks_back_and_stepping_keeps_them_in_the_heap():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    given_back, kept = map(int, out.stdout.split())
    assert given_back >= ROUNDS * PAGES * 0.9, given_back  # every tensor faulted in anew
    assert kept < PAGES, kept  # the heap's blocks reused: not one tensor's pages faulted in
