"""Storage: byte sources to read from (local, remote, CRC-checked), primitives for files to write, raw-byte casts."""
