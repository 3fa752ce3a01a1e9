"""The job of job.toml from Python: the model and the loss passed as callables (Ray pickles them).

    python examples/hf_llama/train.py [--steps 300] [--no-faults]
"""

import argparse
import os
import sys

import elastic_zero as ez

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import build, loss_with_accuracy  # noqa: E402 - the example's own module, beside this file


def job(steps: int = 300, faults: bool = True, name: str = "hf-llama-py") -> ez.Job:
    return ez.Job(
        name=name,
        model=ez.ModelConfig(factory=build, kwargs={"vocab_size": 256, "seq_len": 64}, wrap=["LlamaDecoderLayer"]),
        data="synthetic",
        train=ez.TrainConfig(steps=steps, global_batch=12, micro_batch=4, loss=loss_with_accuracy),
        optimizer={"lr": 3e-3},
        zero={"stage": 3},
        elastic=ez.ScalingConfig(workers=2, min_workers=1, max_workers=3),
        faults=[{"at_step": 8, "action": "kill", "rank": 1}, {"at_step": 16, "action": "scale", "workers": 3}]
        if faults else [],
    ).validate()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--no-faults", action="store_true")
    parser.add_argument("--address", help="a Ray cluster (default: an embedded local Ray)")
    args = parser.parse_args()
    result = ez.run(job(args.steps, not args.no_faults), ez.RunConfig(address=args.address))
    if not result.ok:
        print(f"training failed: {result.error}", file=sys.stderr)
        return 1
    m = result.metrics
    print(f"{m['steps']} steps, loss {m['final_loss']:.4f}, accuracy {m['final_metrics']['accuracy']:.3f}, "
          f"{len(m['recoveries'])} recoveries, {len(m['reconfigurations'])} reconfigurations; outputs in {result.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
