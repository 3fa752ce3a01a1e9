"""What a running job shows: its event log, its live status, its Prometheus metrics, its progress line."""
