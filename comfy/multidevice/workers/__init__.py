"""Ranks as processes: a worker pool driven from this process (rank 0) over torch.distributed."""
