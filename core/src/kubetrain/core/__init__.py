"""kubetrain.core: the TrainingJob API, the worker contract and the lifecycle policy shared by every backend."""

__version__ = "0.1.0"
