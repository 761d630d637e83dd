"""Refs: mutable names moved only through ``RefStore.update``, their history, append logs, writer
leases and the maintenance service."""
