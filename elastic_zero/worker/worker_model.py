"""The model a worker trains and the engine that holds its shard of it. The model is built once at
the worker's start (initial_model.py); the engine is made anew for a generation that starts fresh,
or hollow for one that a handover or a checkpoint fills; both are let go, and the model built again,
when the job starts over from its initial weights. A joiner's model is a skeleton (initial_model.py),
built for real before an engine takes starting values from it."""

from __future__ import annotations

from elastic_zero.job.build import DTYPES
from elastic_zero.worker.initial_model import InitialModel, initial_model
from elastic_zero.zero import ZeroEngine
from elastic_zero.zero.host_memory import release_free_memory


class WorkerModel:
    def __init__(self, spec, device, optimizer, built: InitialModel) -> None:
        self._spec, self.device, self.optimizer = spec, device, optimizer
        self.engine: ZeroEngine | None = None
        self._take(built)

    def _take(self, built: InitialModel) -> None:
        self.model, self.wrap, self.extra = built.model, built.wrap, built.extra
        self._init_values = built.init_values  # a meta model's weights to start from, until its engine takes them
        self._own_init = built.own_init  # and the parameters they lack on purpose (model.new_params)
        self.skeleton = built.skeleton  # no values to start from: a handover or a checkpoint fills its engine

    def new_engine(self, comm, hollow: bool = False) -> ZeroEngine:
        """The worker's engine over `comm` (None: on its own), which replaces the one it had; a meta
        model's starting weights go into it and are let go."""
        if self.skeleton and not hollow:  # its values would be the job's initial ones, which it lacks
            self.start_over()
        spec = self._spec
        self.engine = ZeroEngine(self.model, self.optimizer, stage=spec.zero.stage, process_group=comm,
                                 grad_clip=spec.train.grad_clip, wrap=self.wrap,
                                 compute_dtype=DTYPES[spec.zero.compute_dtype], device=self.device,
                                 init_values=self._init_values, own_init=self._own_init, hollow=hollow)
        self._init_values = None
        release_free_memory()  # the model's own tensors, and a meta model's unit-by-unit values, are gone
        return self.engine

    def standalone_engine(self) -> ZeroEngine:
        """An engine of its own, hollow: a handover or a checkpoint fills it (reconfigure) before it
        trains, and at world size 1 its state would be the whole model's."""
        return self.new_engine(None, hollow=True)

    def start_over(self) -> None:
        """Let go of everything trained and build the model as the job began: the old engine and
        model go first, never two at once."""
        if self.engine is None and not self.skeleton:  # never bound to an engine: it is as the job began
            return
        if self.engine is not None:
            self.engine.release_state()  # after the host copies still reading it (a save's, on a GPU)
            self.engine.close()
        self.engine = self.model = None
        release_free_memory()
        self._take(initial_model(self._spec, self.device))

    def scalars(self) -> dict:
        """The engine's scalars beside its step: its loss scale, where it has one."""
        scale = self.engine.loss_scale
        return {"loss_scale": scale.scale} if scale is not None else {}

    def memory_report(self) -> dict:
        return self.engine.memory_report() if self.engine is not None else {}
