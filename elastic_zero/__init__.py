"""elastic_zero: elastic ZeRO training for PyTorch on Ray.

    import elastic_zero as ez
    result = ez.run(ez.Job(model=build_model, data="tokens.parquet", train={"steps": 100, "loss": my_loss},
                           elastic=ez.ScalingConfig(workers=2, max_workers=4)))
"""

import sys

__version__ = "0.1.0"

from elastic_zero.api import (  # noqa: E402 - the version first, for tools that read it alone
    CheckpointConfig, DataConfig, EvalConfig, Job, ModelConfig, Result, RunConfig, ScalingConfig, TrackingConfig,
    TrainConfig, run,
)
from elastic_zero.service.client import Client, ClusterError  # noqa: E402
from elastic_zero.job import spec  # noqa: E402 - ez.spec.load_spec(...), as docs/service.md shows
from elastic_zero.job.spec import SpecError  # noqa: E402

# the job spec's module kept its older name too (the job's description is the package elastic_zero.job)
sys.modules.setdefault("elastic_zero.spec", spec)

__all__ = ["CheckpointConfig", "Client", "ClusterError", "DataConfig", "EvalConfig", "Job", "ModelConfig", "Result",
           "RunConfig", "ScalingConfig", "SpecError", "TrackingConfig", "TrainConfig",
           "run"]  # and meta_init, loaded when first used


def __getattr__(name: str):
    # torch-using names load when first used: the driver itself never imports torch
    if name == "meta_init":  # a factory's parameters on the meta device (zero/meta.py)
        from elastic_zero.zero.meta import meta_init

        return meta_init
    raise AttributeError(f"module 'elastic_zero' has no attribute {name!r}")
