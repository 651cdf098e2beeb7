"""Loading a checkpoint into a live ``nn.Module``: key mapping, in-place fills, device copies."""
