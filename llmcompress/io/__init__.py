"""Model I/O: loading, architecture adapters, layer surgery and checkpoints."""
