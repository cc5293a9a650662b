"""The package version, one source for the package, its metadata and checkpoint records."""

__version__ = "0.1.0"
