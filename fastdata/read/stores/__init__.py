"""Decoded splits kept whole: the on-disk cache and the padded store."""
