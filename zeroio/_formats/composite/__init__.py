"""Layouts built from other layouts: pipeline stages, tensor-parallel ranks, universal folders."""
