"""infersight bootstrap: activates the hooks in every Python process ``launch`` starts.

``launch`` (or the ``.pth`` file with ``INFERSIGHT=1``) puts this directory on
PYTHONPATH. It loads ``infersight.hooks`` even where infersight is not installed in
this interpreter, activates it, then chains to any other ``sitecustomize`` on the path.
Stdlib only; any failure prints one line and leaves the process untouched.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load_hooks() -> object:
    try:
        from infersight import hooks  # installed in this interpreter

        if os.path.dirname(os.path.abspath(hooks.__file__)) == os.path.dirname(_HERE):
            return hooks
        # An installed infersight of another version: use the one launch ships with.
    except ImportError:
        pass
    # importlib.machinery rather than importlib.util: the latter pulls in contextlib,
    # collections and functools, a few ms of start-up the host would pay for nothing.
    import importlib.machinery

    module_type = type(sys)
    pkg = sys.modules.get("infersight")
    if pkg is None:
        pkg = module_type("infersight")
        pkg.__path__ = []  # type: ignore[attr-defined]
        sys.modules["infersight"] = pkg
    hooks_dir = os.path.dirname(_HERE)
    init = os.path.join(hooks_dir, "__init__.py")
    loader = importlib.machinery.SourceFileLoader("infersight.hooks", init)
    spec = importlib.machinery.ModuleSpec("infersight.hooks", loader, origin=init, is_package=True)
    spec.submodule_search_locations = [hooks_dir]
    spec.has_location = True
    module = module_type("infersight.hooks")
    module.__spec__ = spec
    module.__loader__ = loader
    module.__file__ = init
    module.__path__ = [hooks_dir]  # type: ignore[attr-defined]
    module.__package__ = "infersight.hooks"
    sys.modules["infersight.hooks"] = module
    loader.exec_module(module)
    pkg.hooks = module  # type: ignore[attr-defined]
    return module


def _activate() -> None:
    try:
        _load_hooks()
        from infersight.hooks import _activate as act
        from infersight.hooks import _env

        if _env.get("INFERSIGHT"):  # a value that is no boolean: said once, and the hooks stay on
            act.activate_process()
    except Exception as exc:
        try:
            where = ""
            if isinstance(exc, OSError):  # e.g. infersight's install not readable by this process's user
                where = (" (%s: this user, uid %d, must be able to read infersight's install, %s, and enter each "
                         "directory above it; `infersight hooks install --python %s` names the first it cannot, "
                         "and the fix)" % (exc.filename or _HERE, os.getuid(), os.path.dirname(os.path.dirname(_HERE)),
                                           sys.executable))
            sys.stderr.write("infersight: bootstrap failed, running without hooks: %r%s\n" % (exc, where))
        except Exception:
            pass


def _chain() -> None:
    """Run the next sitecustomize on sys.path, the one ours shadows, once: only where ``site``
    imported ours as ``sitecustomize``. ``hooks install``'s ``.pth`` line runs this file first with
    ``runpy`` (``__name__`` is then not ``sitecustomize``), while ``site`` still reads the later
    ``.pth`` files; ``site`` imports it again after them, and that run chains, when the paths those
    files add are in place."""
    if __name__ != "sitecustomize":
        return
    path = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    if not any(os.path.exists(os.path.join(p or ".", "sitecustomize.py")) or
               os.path.isdir(os.path.join(p or ".", "sitecustomize")) for p in path):
        return  # the common case: nothing to chain, and importlib stays unimported
    import importlib.machinery
    import importlib.util

    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    # The hooks' watch for the program's first line is paused meanwhile: what this file imports (a large
    # package, at times) is start-up all the same, but not worth a profile call per Python call.
    watch = sys.modules.get("infersight.hooks._mainstart")
    paused = False
    try:
        paused = bool(watch is not None and watch.pause())
    except Exception:
        pass
    try:
        module = importlib.util.module_from_spec(spec)
        sys.modules["_infersight_chained_sitecustomize"] = module
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.stderr.write("infersight: chained sitecustomize failed: %r\n" % (exc,))
    finally:
        if paused:
            try:
                watch.resume()  # type: ignore[union-attr]
            except Exception:
                pass


# The switch's "off" words (hooks/_env.py FALSE_WORDS; a test holds the two equal): checked here so
# that a process told to stay unhooked loads nothing of ours. Any other value loads the hooks,
# whose _env then says once if it is not a boolean (and takes the default here: on, as this
# directory is on PYTHONPATH). The .pth line runs this file only for an "on" word: it says a
# bad value itself and leaves the hooks off, its own default.
OFF = ("0", "false", "no", "off")
if os.environ.get("INFERSIGHT", "").strip().lower() not in OFF:
    _activate()
_chain()
