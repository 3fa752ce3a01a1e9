"""The worker side: shard handover between generations, buddy replication, the Ray worker actor."""
