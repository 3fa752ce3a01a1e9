"""Pure planning: layouts, partitions, reshard plans. Standard library only.

Nothing here imports torch.distributed, Ray, pyarrow, os or time; time is an argument.
"""

from elastic_zero.plan.layout import FlatLayout, ParamSlot, UnitSpan, build_layout, ParamSpec
from elastic_zero.plan.partition import Partition, Piece, partition_layout, shard_pieces
from elastic_zero.plan.reshard import Transfer, plan_reshard

__all__ = [
    "FlatLayout",
    "ParamSlot",
    "ParamSpec",
    "UnitSpan",
    "build_layout",
    "Partition",
    "Piece",
    "partition_layout",
    "shard_pieces",
    "Transfer",
    "plan_reshard",
]
