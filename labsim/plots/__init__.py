"""Presentation: matplotlib figures, one module per kind of plot (matplotlib is imported here
only)."""
