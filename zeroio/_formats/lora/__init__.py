"""LoRA (PEFT) checkpoints: adapter names, adapter_config.json, and views (one adapter; the merged base model)."""
