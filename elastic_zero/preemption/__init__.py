"""Signals that a node or a worker is about to go, read into notices: SIGTERM, the clouds' metadata
servers (AWS, GCP, Azure) and Ray's node draining. See docs/preemption.md."""
