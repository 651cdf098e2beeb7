"""Optimizer state views: per-rank moments gathered into per-parameter tensors."""
