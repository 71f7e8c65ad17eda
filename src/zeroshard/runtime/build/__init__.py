"""Building a sharded model: ranks agree, rank 0's state broadcast, units chosen and
made, meta-device models materialized unit by unit."""
