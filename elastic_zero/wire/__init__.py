"""The wire: what workers and the coordinator say to each other outside Ray's calls.

- `store_server.py` — the job's key-value store, with torch's TCPStore protocol, in Python (the
  standard library only; the relay loads it by path);
- `store_client.py` — the coordinator's own client of that store;
- `rendezvous.py` — the store behind the job's secret: the coordinator's relay (a process of its
  own) and each worker's local relay that answers its challenge;
- `heartbeats.py` — the workers' heartbeats, one UDP datagram each, from a small process of their
  own, with their training's progress;
- `beat_listener.py` — the coordinator's side: the heartbeat socket and what its drains said;
- `beat_drain.py` — the listener's drain of its socket, a process of its own (the standard library
  only; the listener starts it by path);
- `generation_ends.py` — a generation's end (or abort) as one store key.

Imports run one way: rendezvous -> store_client -> store_server; beat_listener -> heartbeats -> beat_drain;
generation_ends stands alone. Nothing here imports the rest of the package (node_memory.py, loaded by path).
"""
