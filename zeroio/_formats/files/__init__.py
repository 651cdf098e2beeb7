"""Plain weight files: consolidated safetensors / torch files and their shard indexes."""
