"""The package version: read by the build backend and mixed into the code-generation cache key."""

__version__ = "0.1.0"
