"""Jobs on a Ray cluster: submission through the Ray Jobs API, control of a running job, the token."""
