"""The read backends: cpu, memory, nvjpeg, dali, and `auto`."""
