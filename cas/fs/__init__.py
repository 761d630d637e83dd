"""The store as a filesystem: fsspec ``cas://``, file views of checkpoints, writes and a FUSE mount."""
