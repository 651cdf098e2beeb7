"""ZeRO layouts: DeepSpeed's per-rank model and optimizer files, stage 0 to 3 and their variants."""
