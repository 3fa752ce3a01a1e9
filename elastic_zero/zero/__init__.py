"""The ZeRO engine: sharded parameters, gradients and optimizer state over data-parallel ranks."""

from elastic_zero.zero.comm import Comm, SingleComm, TorchComm, as_comm, new_process_group
from elastic_zero.zero.engine import ZeroEngine
from elastic_zero.zero.optim import SGD, AdamW, ParamGroup
from elastic_zero.zero.schedule import Constant, WarmupCosine
from elastic_zero.zero.shard import ShardState, reshard
from elastic_zero.zero.unit_flow import StepInterrupted

__all__ = [
    "AdamW",
    "Comm",
    "Constant",
    "ParamGroup",
    "SGD",
    "ShardState",
    "StepInterrupted",
    "SingleComm",
    "TorchComm",
    "WarmupCosine",
    "ZeroEngine",
    "as_comm",
    "new_process_group",
    "reshard",
]
