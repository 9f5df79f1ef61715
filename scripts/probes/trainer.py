"""What a user's trainer factory imports: ``from probes.trainer import apply_settings``.

The module is ``probes.step.factory``; this name is the one a factory writes.
"""

from probes.step.factory import MODEL_KEYS, apply_settings, model_kwargs

__all__ = ["MODEL_KEYS", "apply_settings", "model_kwargs"]
