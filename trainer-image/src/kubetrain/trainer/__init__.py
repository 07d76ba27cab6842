"""kubetrain worker runtime: DDP, FSDP2 and DeepSpeed ZeRO training with exact resume.

Entry point: ``python -m kubetrain.trainer`` (see :mod:`kubetrain.trainer.main`).
"""

__all__: list[str] = []
