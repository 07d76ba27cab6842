"""Checkpoints: when and where to save (manager), the directory format and its commit rule (directory),
background durable writes (background), the per-rank memory tier (memory), object storage (object_store),
the older single-file layout (legacy) and safe loading (safe_load). They see an engine only through the
protocols of savable.py."""
