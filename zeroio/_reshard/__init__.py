"""Rewriting a ZeRO-3 checkpoint for another world size (rank files DeepSpeed resumes from)."""
