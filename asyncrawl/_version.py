"""The package's version, in a module of its own (imported by the CLI, the run record and the
HTTP client's User-Agent)."""

__version__ = "0.1.0"
