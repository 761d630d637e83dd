"""Moving checkpoints between stores: push, pull and archive."""
