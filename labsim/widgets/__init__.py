"""Presentation: ipywidgets explorers, one module per widget, each over a pure labsim function
that also draws a static fallback figure (ipywidgets is imported here only)."""
