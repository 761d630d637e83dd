"""Training-loop support: the checkpoint manager, async saves, history, pool, signals, integrations."""
