"""kubetrain for training scripts built on other libraries, run as a custom command (spec.command).

Shipped in the trainer distribution (kubetrain-trainer), beside kubetrain.trainer.observe.progress whose reporter
they use: an image with kubetrain's trainer package has them. Each module imports its library at import time,
so only `kubetrain.integrations.transformers` needs transformers (the trainer's `hf` extra).
"""
