"""The harness the tests and the benchmarks run on, real things on one machine:

- `local_group.py` — torch process groups of a few local processes (gloo), for the engine's tests;
- `local_cluster.py` — a Ray head (and raylets) started and stopped by process id, and a job's
  status read from it;
- `autoscaled_cluster.py` — a head that runs Ray's autoscaler over its fake multi-node provider;
- `sim_workers.py`, `sim_workforce.py` — simulated workers, many to a process, that speak the
  coordinator's protocol, for the control plane at a thousand workers.
"""
