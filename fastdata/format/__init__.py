"""The on-disk contract: sample schema, fields, manifest, integrity, carve."""
