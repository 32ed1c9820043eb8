"""The version of autoplan, written into every plan file."""

__version__ = "0.1.0"
