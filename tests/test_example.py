import os
import subprocess
import sys

import torch

from elastic_zero.models import build_preset

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "train_gpt_zero.py")
ARGS = ["--preset", "gpt-tiny", "--stage", "3", "--steps", "4"]


def test_example_under_torchrun_matches_one_process(tmp_path):
    """Oracle: the same global batches on one process (two ranks of 4 samples = one rank of 8)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    two = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", EXAMPLE, *ARGS,
                          "--batch-per-rank", "4", "--save", str(tmp_path / "two.pt")],
                         capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-2000:]
    one = subprocess.run([sys.executable, EXAMPLE, *ARGS, "--batch-per-rank", "8", "--save", str(tmp_path / "one.pt")],
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    a = torch.load(tmp_path / "one.pt", weights_only=True)
    b = torch.load(tmp_path / "two.pt", weights_only=True)
    assert a.keys() == b.keys()
    va = torch.cat([a[k].flatten() for k in a])
    vb = torch.cat([b[k].flatten() for k in a])
    assert ((va - vb).norm() / va.norm()).item() < 1e-5
    start = torch.cat([v.flatten() for v in build_preset("gpt-tiny", seed=0).state_dict().values()])
    assert (va - start).norm() > 100 * (va - vb).norm()  # training moved the weights far more than the gap
