"""The Repository facade (its method groups in ``refs``, ``housekeeping``, ``transfers``), opening
a store by URL, config, ingest, export, shards and archive."""
