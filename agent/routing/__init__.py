"""Routing hints: HAProxy agent-check replies, and weights for routers that scrape."""
