import os
import sys

# This machine's DNS server drops about one query in 25, and torch's TCPStore resolves the name of
# both ends of every store connection (a reverse lookup of 127.0.0.1 in its IPv4-mapped form, which
# /etc/hosts does not answer): a dropped query stalls that connection 5 s, glibc's timeout (measured:
# 4 of 110 connections made in a row). One second per try here instead; Ray's processes inherit it.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:2")

# The log monitor of each local Ray the tests start with ray.init (a test process's, a driver's) looks
# for new log files ten times a second while it has fewer than this many; with none it looks every
# 0.5 s (Ray's pace past the threshold). Its cost grows with the files the suite leaves: a session's
# cluster spent 12 s of a core on it (measured; at 207 files, 3.2% of a core against 1.7%). No test
# reads a worker's output through it.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")

import pytest
import torch

# Spawned ranks inherit sys.path, so helper modules in tests/ import there too.
sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)
# Every job and local group the tests start checks the traffic split (zero/host_memory.py): a host
# buffer on a training group, or anything else on a host group, fails it at once.
os.environ["ELASTIC_ZERO_CHECK_TRAFFIC"] = "1"

# The tiers: `pytest -m unit` runs in seconds (pure logic and single-process engine checks);
# `runtime` tests start Ray or local process groups; `slow` ones take a minute or more; `long` ones
# run an example or a bench end to end over minutes, whose parts shorter tests cover, or a behaviour
# CI checks at another size or stage (CI's two cores are spent mostly importing torch in each worker
# a test starts: 2-3 s of a core each): CI leaves them out (README.md's command), `pytest -m long`
# runs them.
_RUNTIME = {"test_runtime.py", "test_runtime_hardening.py", "test_cli.py", "test_example.py", "test_abortable.py",
            "test_engine_parity.py", "test_engine_reshard.py", "test_handover.py", "test_checkpoint.py",
            "test_engine_state.py", "test_engine_races.py", "test_gpu.py", "test_chaos.py", "test_own_model.py",
            "test_local_group.py", "test_gloo_comm.py"}
_SLOW = {"test_runtime.py", "test_engine_parity.py", "test_chaos.py", "test_own_model.py"}


def pytest_configure(config):
    for name, text in (("unit", "pure logic and one-process checks: seconds"),
                       ("runtime", "starts Ray actors or local process groups"),
                       ("slow", "a minute or more"),
                       ("long", "an example or a bench end to end, or a repeat at another size: run by command "
                                "(-m long), not by CI")):
        config.addinivalue_line("markers", f"{name}: {text}")
    if not hasattr(config, "workerinput"):  # once, in the process that hands out the tests
        _compile_bytecode()


def _compile_bytecode() -> None:
    """The package's, the examples' and these tests' bytecode, written once before any test runs.
    This machine sets PYTHONDONTWRITEBYTECODE, and an editable install compiles nothing, so every
    process the suite starts (hundreds: drivers, coordinators, workers) compiled the package anew:
    0.2 s of CPU each, measured in a worker's imports. Python checks each file against its source,
    so an edit is never read stale; compileall writes whatever that variable says."""
    import compileall

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for folder in ("elastic_zero", "examples", "tests"):
        compileall.compile_dir(os.path.join(root, folder), quiet=2)


# The files of the longest tests (a minute or more each, or many of half a minute), run first: the
# README's command runs two test processes side by side (pytest-xdist), which take one test at a time
# (--maxschedchunk 1, pyproject.toml), and a long test handed out last would leave one of them idle
# at the end (the tracking tests, last by name, left one process 17 s alone at the end of a CI run)
_LONGEST_FIRST = ("test_goodput_bench.py", "test_service.py", "test_demo.py", "test_finetune_example.py", "test_nodes.py",
                  "test_own_model.py", "test_large_model_path.py", "test_runtime.py", "test_chaos.py",
                  "test_bench_memory.py", "test_control_plane_bench.py", "test_runtime_hardening.py",
                  "test_tracking.py", "test_standby_loss.py")


def pytest_collection_modifyitems(items):
    for item in items:
        module = os.path.basename(str(item.fspath))
        has_own = {m.name for m in item.iter_markers()}
        if "runtime" not in has_own and "unit" not in has_own:
            item.add_marker(pytest.mark.runtime if module in _RUNTIME else pytest.mark.unit)
        if module in _SLOW:
            item.add_marker(pytest.mark.slow)
    # stable: the same order in every test process, as xdist requires
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(rank)))


@pytest.fixture(scope="session")
def local_ray():
    import ray

    ray.init(num_cpus=6, namespace="elastic_zero", include_dashboard=False, logging_level="ERROR")
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def torch_adamw():
    """The oracle of the runtime tests (torch_oracle.py): `torch_adamw(steps, global_batch=8)`, the
    weights of torch's AdamW on one process after `steps` steps of the tests' job. Computed in this
    process, 12 ms of a core a step; a one-worker job on Ray for each (steps, batch), as before, cost
    2.6-9 s of a core."""
    from runtime_jobs import job_spec
    from torch_oracle import AdamWTrajectory

    trajectories, cache = {}, {}

    def weights(steps, global_batch=8):
        key = steps, global_batch
        if key not in cache:
            if global_batch not in trajectories:
                trajectories[global_batch] = AdamWTrajectory(job_spec("oracle", train={"global_batch": global_batch}))
            cache[key] = trajectories[global_batch].weights_at(steps)
        return cache[key]

    return weights
