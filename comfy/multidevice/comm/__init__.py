"""Communication between ranks: the coordinator, its backends (peer, HCCL, NCCL) and torch.distributed."""
