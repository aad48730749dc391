"""infersight: telemetry agent for hosts that serve PyTorch models on GPUs.

This top-level package is deliberately tiny: the served process imports it on the
way to ``infersight.hooks``, so it must not pull in the agent or the OTel SDK.
"""

__version__ = "0.1.0"
