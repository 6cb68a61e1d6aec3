"""DataLoader workers and the shared memory batches cross."""
