"""Attention backends, one file each; every module here not starting with ``_`` is imported
by :func:`multihead.functional.registry.discover` and registers itself."""
