"""The mixed-precision KV cache (BF16 sink and recent windows, INT2 history)."""
