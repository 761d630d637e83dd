"""Integrations with training frameworks; each module imports its framework only when imported.

``cas.training.integrations.hf`` (transformers TrainerCallback), ``cas.training.integrations.lightning``
(Lightning CheckpointIO), ``cas.training.integrations.dcp`` (torch.distributed.checkpoint storage).
"""
