"""The package's version, in a module of its own (imported by the CLI and the run record)."""

__version__ = "0.1.0"
