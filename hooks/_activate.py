"""What the bootstrap runs in each hooked process (stdlib only).

Starts the producer client and the cold-start root, then cold-start detection
(``_coldstart``): runtime_init, framework imports, readiness, and torch
instrumentation once (and only if) the user imports torch.
"""

from __future__ import annotations

from . import _proc, _runtime


def _install_allocator_hooks(torch: object) -> None:
    """Once the host imports torch: OOM capture and allocator telemetry (``_alloc``)."""
    from . import _alloc

    _alloc.install(torch)


def _install_engine_log(logging: object) -> None:
    """Serving engines' memory errors logged through ``logging`` (``_enginelog``)."""
    from . import _enginelog

    _enginelog.install_logging(logging)


def activate_process() -> bool:
    if _proc.is_own_cli(_proc.command_argv()):
        return False  # infersight's own CLI (``INFERSIGHT=1 infersight status``) is no producer
    if not _runtime.activate():
        return False
    try:
        from . import _BOOT_NS, _coldstart

        _coldstart.install(_BOOT_NS, from_bootstrap=True)
        _coldstart.on_import("torch", _install_allocator_hooks)
        _coldstart.on_import("logging", _install_engine_log)
        from . import _enginelog

        _enginelog.install_excepthooks()  # chained: an engine's uncaught memory error, torch or not
    except Exception as exc:
        _runtime.fail(exc)
    return True
