"""Where a sample is decoded on the CPU: bytes -> uint8 pixels, fields."""
