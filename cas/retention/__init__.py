"""Retention and garbage collection: policies, forget plans, GC, space accounting and verification."""
