"""Free loopback ports for the processes a test starts: the product's own choice (kubetrain.core.ports)."""

from kubetrain.core.ports import free_port

__all__ = ["free_port"]
