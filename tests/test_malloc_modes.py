"""The workers' two rules for glibc's malloc (zero/host_memory.py), in a process of their own
(mallopt is process-wide). Oracle: the kernel's count of page faults. Memory given back to the
system comes back as fresh pages (a fault per 4 KiB) when allocated again; memory kept in the
heap is reused without one."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

_PROBE = r"""
import resource, sys, torch
from elastic_zero.zero import host_memory

def faults_of_a_second_8mb_tensor():
    torch.ones(2 << 20)  # 8 MB, allocated, written, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(2 << 20)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

host_memory.large_allocations_to_the_system()
faults_of_a_second_8mb_tensor()  # (glibc's own rule would keep the second one in its heap)
given_back = faults_of_a_second_8mb_tensor()
host_memory.release_free_memory()
host_memory.step_allocations_in_the_heap()
faults_of_a_second_8mb_tensor()  # the first one below the new threshold goes into the heap
kept = faults_of_a_second_8mb_tensor()
print(given_back, kept)
"""


def test_building_gives_large_blocks_back_and_stepping_keeps_them_in_the_heap():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    given_back, kept = map(int, out.stdout.split())
    assert given_back >= 1500, given_back  # 2,048 pages of 4 KiB, each faulted in anew
    assert kept < 200, kept
