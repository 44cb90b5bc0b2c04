"""autotune's version: one home, read by the package face, the environment fingerprint and the
packaging metadata (pyproject.toml's dynamic version)."""

__version__ = "0.1.0"
