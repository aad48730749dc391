"""The hooks' lazy imports of their own submodules, safe when the files on disk changed (stdlib only).

The hooks import several submodules only when needed (``_build`` once tokenizers load, ``asgi`` once
uvicorn does, ``_listening`` at the first socket poll...). A process that loaded the hooks and then has
infersight upgraded under it (pip replaces the files) would import the NEW file next to the OLD modules in
memory, which need not fit them: an ``AttributeError`` then disabled the whole hooks, and every later event
of the process was lost. Every such import asks :func:`fresh` first: when the files changed since the hooks
loaded, it says so in one stderr line per feature and the caller turns only that feature off; the modules
already loaded (spans, the spool, the client's connection) work on.

Changed means: the package's ``__init__`` is no longer the file the process loaded (another inode, size
or modification time: pip writes new files, a moved or removed install has none), or the submodule's file
is gone or its inode changed (``st_ctime_ns``, which no copy or install can set back) after the hooks
loaded. Two ``stat`` calls at a submodule's first import only; a loaded one is a ``sys.modules`` look-up.
The submodules a checked one imports at its top are not checked one by one: an upgrade writes the package's
``__init__`` anew too. A ``chmod`` or ``chown`` of the files after the start reads as a change (the
features it names wait for the restart). The imports made while the hooks activate (``_enginelog``,
``_sampler``, ``_checkpoint``, ``_imports``) come right after the load and are not asked.
"""

from __future__ import annotations

import os
import sys
import time

from ._env import say

TYPE_CHECKING = False  # the typing module costs ~10 ms at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Dict, Optional, Tuple

_PACKAGE = __name__.rpartition(".")[0]
_DIR, _SUFFIX = os.path.split(__file__)[0], os.path.splitext(__file__)[1]  # ".py", or ".pyc" where sourceless
_INIT = os.path.join(_DIR, "__init__" + _SUFFIX)


def _identity(path: str) -> Optional[Tuple[int, int, int, int]]:
    """What tells one file at ``path`` from another written there later; None when it is not there."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


# Taken as the package is imported (its first modules import this one: what is in memory was read from these
# files). None where the files are no plain files (a zip): nothing to compare, every import goes on.
_LOADED_NS = time.time_ns()
_LOADED = _identity(_INIT)

_changed: Dict[str, bool] = {}  # submodule -> whether its file changed (asked once per submodule)
_off: Dict[str, object] = {}  # feature -> the token of the thread that said it is off (said once)


def changed(name: str) -> bool:
    """Whether the submodule ``name``'s file, or the package's, changed on disk since the hooks loaded."""
    if _LOADED is None:
        return False
    known = _changed.get(name)
    if known is not None:
        return known
    if _identity(_INIT) != _LOADED:
        verdict = True
    else:
        try:
            verdict = os.stat(os.path.join(_DIR, name + _SUFFIX)).st_ctime_ns > _LOADED_NS
        except OSError:
            verdict = True  # gone: removed by an uninstall, or the install moved
    _changed[name] = verdict
    return verdict


def fresh(name: str, feature: str) -> bool:
    """Whether the caller may import the hooks' submodule ``name`` (``from . import name``): it is loaded
    already, or its files did not change since the hooks loaded. Else False, and ``feature`` (what the
    caller turns off, for the line on stderr) is said off, once."""
    if _PACKAGE + "." + name in sys.modules or not changed(name):
        return True
    token = object()
    if _off.setdefault(feature, token) is token:  # (atomic: one thread says it)
        say("the hooks' files changed under this process (an upgrade?): %s is off until it restarts" % feature)
    return False
