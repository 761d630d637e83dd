"""Refs: mutable names moved only by compare-and-swap, their history, and writer leases."""
