"""The base of the agent's exceptions."""

from __future__ import annotations

from infersight.errors import InfersightError


class AgentError(InfersightError):
    """Base of the exceptions of infersight.agent (its config errors are also
    :class:`~infersight.settings.ConfigError`)."""
