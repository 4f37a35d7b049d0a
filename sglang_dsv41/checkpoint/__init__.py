"""Checkpoint format: codecs, tensor inventory, reader, verify, synthetic checkpoints."""
