"""infersight.exporters."""
