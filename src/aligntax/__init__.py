"""aligntax: measure and cut the alignment tax of open-weight LLMs."""

__version__ = "0.1.0"
