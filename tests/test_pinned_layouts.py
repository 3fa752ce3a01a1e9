"""When a worker gives torch's cached pinned blocks back (worker/pinned_layouts.py). Pure: the
release is counted; tests/test_gpu.py checks what it frees on a GPU."""

import pytest

from elastic_zero.worker.pinned_layouts import PinnedLayouts

pytestmark = pytest.mark.unit


def test_a_release_is_due_once_the_shard_needs_other_blocks_and_runs_when_nothing_old_is_held():
    released = []
    pins = PinnedLayouts(lambda: released.append(True))
    pins.entered(1000)  # 4,000 bytes a vector: blocks of 4,096
    assert not pins.settle(old_layout_held=False) and released == []  # the first layout: nothing left behind
    pins.entered(600)  # a larger world: 2,400 bytes, the same blocks, which the new layout reuses
    assert not pins.settle(old_layout_held=False)
    pins.entered(300)  # 1,200 bytes: blocks of 2,048; the 4,096 ones are asked for no more
    assert not pins.settle(old_layout_held=True)  # the layout before still replicated, or a save of it written
    assert pins.settle(old_layout_held=False) and released == [True]
    assert not pins.settle(old_layout_held=False)  # once
    pins.entered(300)
    pins.entered(1000)  # back to the larger blocks: the 2,048 ones are left
    pins.entered(1000)
    assert pins.settle(old_layout_held=False) and len(released) == 2


def test_replicas_dropped_for_room_make_a_release_due_at_the_same_size():
    released = []
    pins = PinnedLayouts(lambda: released.append(True))
    pins.entered(1000)
    pins.dropped()
    assert pins.settle(old_layout_held=False) and released == [True]
