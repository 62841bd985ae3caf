"""The decode engine: rows, rounds, the KV cache's bookkeeping, rows joining and leaving a running batch."""
