"""The package's version, in a module below `tpudist/__init__` because no module under the package
imports the package itself (`tpudist.cli --version` reads it here)."""

__version__ = "0.1.0"
