"""What the bootstrap runs in each hooked process (stdlib only).

Starts the producer client and the cold-start root. Framework instrumentation
(torch import, CUDA init, weights, compile, warmup) installs from here too.
"""

from __future__ import annotations

from . import _runtime


def activate_process() -> bool:
    return _runtime.activate()
