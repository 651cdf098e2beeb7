"""PyTorch Distributed Checkpoint folders: the .metadata checked, chunks planned, tensors read."""
