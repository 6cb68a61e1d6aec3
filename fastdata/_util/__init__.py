"""The library's own small helpers (threads, tensor pool, C extensions)."""
