"""infersight.agent."""
