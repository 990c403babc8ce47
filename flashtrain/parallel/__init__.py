"""Parallelism over the sequence (context parallelism). The API is in flashtrain.parallel.ring_attention (ring
attention, shard_positions, shard_sequence, unshard_sequence; not re-exported here, so that the module's name stays
the module); the per-block schedule and primitives it runs in flashtrain.parallel.blockwise."""
