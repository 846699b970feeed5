"""Sequence parallelism: the shard plan, the K/V exchange modes, the fan-out and the MiniMax-H3 adapter."""
