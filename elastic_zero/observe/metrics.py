"""The job's Prometheus metrics, through Ray's metrics agent (`ray.util.metrics`): Ray exports them
on each node's metrics port with the prefix `ray_`, tagged with the job's id. docs/metrics.md lists them."""

from __future__ import annotations

METRICS = {  # name: (kind, description)
    "elastic_zero_step_seconds": ("gauge", "time of the latest step on rank 0, seconds"),
    "elastic_zero_samples_per_second": ("gauge", "training throughput over the last seconds, samples/s"),
    "elastic_zero_loss": ("gauge", "loss of the latest step"),
    "elastic_zero_eval_loss": ("gauge", "loss of the latest evaluation on the eval set"),
    "elastic_zero_eval_perplexity": ("gauge", "perplexity of the latest evaluation, where the loss is token cross-entropy"),
    "elastic_zero_step": ("gauge", "optimizer steps done"),
    "elastic_zero_world_size": ("gauge", "workers in the current generation"),
    "elastic_zero_generation": ("gauge", "the current generation number"),
    "elastic_zero_recoveries": ("counter", "recoveries from a lost worker or a failed collective"),
    "elastic_zero_reconfigurations": ("counter", "planned changes of the world: scale up or down, preemption leaves"),
    "elastic_zero_stall_seconds": ("counter", "seconds training stood still for recoveries and reconfigurations"),
    "elastic_zero_checkpoint_stall_seconds": ("counter", "seconds training waited for checkpoint saves"),
    "elastic_zero_checkpoints": ("counter", "checkpoints committed"),
}


class JobMetrics:
    """One job's metrics; every call is a no-op where Ray's metrics cannot be made."""

    def __init__(self, job_id: str) -> None:
        self._tags = {"job": job_id}
        self._metrics: dict = {}
        try:
            from ray.util.metrics import Counter, Gauge

            for name, (kind, text) in METRICS.items():
                self._metrics[name] = (Gauge if kind == "gauge" else Counter)(name, text, tag_keys=("job",))
        except Exception:  # noqa: BLE001 - metrics are an aid, never a reason to fail a job
            self._metrics = {}

    def set(self, name: str, value: float | None) -> None:
        metric = self._metrics.get(name)
        if metric is not None and value is not None:
            metric.set(float(value), tags=self._tags)

    def add(self, name: str, value: float = 1.0) -> None:
        metric = self._metrics.get(name)
        if metric is not None and value:
            metric.inc(float(value), tags=self._tags)
