"""The package version (one place: the package, checkpoints and exported models read it here)."""
__version__ = "0.1.0"
