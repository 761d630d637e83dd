"""Refs: mutable names moved only through ``RefStore.update``, their history, append logs, writer
leases, the maintenance service, and ``Stores``, the bundle the layers above work through."""
