"""infersight.rules."""
