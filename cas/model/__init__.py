"""The checkpoint model: manifests, the state tree and descriptions of checkpoints; no store access."""
