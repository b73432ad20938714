"""Lossless compression of checkpoints (ZipCCL exponent coding)."""
