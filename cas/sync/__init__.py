"""Moving checkpoints between stores: push and pull (archive, which also frees, is in ``cas.repo``)."""
