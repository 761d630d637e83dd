"""Integrations with training frameworks; each module imports its framework only when imported.

``cas.integrations.hf`` (transformers TrainerCallback), ``cas.integrations.lightning``
(Lightning CheckpointIO), ``cas.integrations.dcp`` (torch.distributed.checkpoint storage).
"""
