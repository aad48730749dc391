"""Stage rules inside the served process: ``module:qualname`` -> a stage (stdlib only).

The rule files are TOML (``rules/stages.toml`` shipped beside these hooks, then ``*.toml`` in
the rules directories: ``$INFERSIGHT_RULES_DIRS``, separated by ``:`` or ``,``, default
``/etc/infersight/rules.d``). tomllib is Python 3.11+ and the hooks run on 3.9, so this module
reads the one subset of TOML that stage rules are written in: ``[[stage]]`` tables whose
``id``, ``stage`` and ``targets`` are plain strings (no escapes) and an array of them, and
``ready`` a bare ``true``/``false`` (the process is ready when an outermost call returns) or
``"entry"`` (ready when the call starts: a serving loop that runs until shutdown, no span) or
``"helper"`` (as ``"entry"``, and the process is a helper: a multiprocessing manager's loop), and
``until``, an array like ``targets`` (the stage runs from a target's call to the first call of
one of these: a loop's wait for its first piece of work); other
keys, tables (``[[stage.examples]]``) and multi-line strings are skipped. The agent's loader
(``infersight.rules.stage_rules``, with tomllib) validates every file with file:line errors,
and ``infersight.agent.coldstart.stage_rules_check`` refuses a file this reader would read
differently. A file OOM rules use (``[[rule]]`` tables) has no ``[[stage]]`` and adds nothing.

Nothing is wrapped up front: each target's module gets a post-import callback
(``_recorder.on_import``), so a process that never imports vllm pays one set lookup per
import and nothing else. When the module is imported, each target found there is wrapped
(a function, a method, a classmethod or staticmethod, sync or async) so that its calls
are a ``coldstart.<stage>`` span with ``infersight.stage.rule`` and ``.target``; a call
inside a span of the same stage opened by a rule passes through. Targets the module does
not define (another version of the library) are listed on the root as
``infersight.stage_rules.missing``; unreadable files as ``infersight.stage_rules.errors``.
Every wrapper is taken out when the root ends (``_readiness.uninstall``).
"""

from __future__ import annotations

import contextvars
import os
import time

from . import _contract, _env, _readiness, _runtime
from . import _recorder as cs

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional, Tuple

    Rule = Tuple[str, str, Tuple[str, ...], str, Tuple[str, ...]]  # (id, stage, targets, ready: READY_*, until)
    Spec = Tuple[str, str, str, str]  # what a wrapped target does: (stage, rule id, ready, ROLE_*)

ENGINE_MAJOR = 1  # engine_version "1.x" files load
SITE_DIR = "/etc/infersight/rules.d"
MAX_FILES = 64
MAX_BYTES = 1 << 20  # a rule file larger than this is not read
MAX_LISTED = 20  # entries of the root's missing / errors lists
READY_NEVER, READY_AT_RETURN, READY_AT_ENTRY, READY_AS_HELPER = "", "return", "entry", "helper"  # a rule's ``ready``
_READY_VALUES = {"false": READY_NEVER, "true": READY_AT_RETURN, '"return"': READY_AT_RETURN,
                 '"entry"': READY_AT_ENTRY, '"helper"': READY_AS_HELPER}
ROLE_CALL, ROLE_WAIT, ROLE_UNTIL = "", "wait", "until"  # a call is the stage / starts / ends its wait
_CO_COROUTINE = 0x80
_CO_GENERATORS = 0x20 | 0x200  # generator, async generator: their work runs after the call

_open_stages: contextvars.ContextVar[Tuple[str, ...]] = contextvars.ContextVar(
    "infersight_rule_stages", default=())


# -- reading rule files ------------------------------------------------------------------


def _string(v: str) -> Optional[str]:
    """A one-line TOML string without escapes, else None."""
    if len(v) >= 2 and v[0] == v[-1] and v[0] in "\"'" and v[0] not in v[1:-1] and "\\" not in v:
        return v[1:-1]
    return None


def _strip_comment(v: str) -> str:
    """``v`` without a trailing ``# comment`` outside strings."""
    quote = ""
    for i, ch in enumerate(v):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            return v[:i].rstrip()
    return v.rstrip()


def _array(v: str) -> Optional[Tuple[str, ...]]:
    """``["a", "b"]`` of plain strings, else None."""
    if not (v.startswith("[") and v.endswith("]")):
        return None
    out = []
    for raw in v[1:-1].split(","):
        item = raw.strip()
        if not item:
            continue
        s = _string(item)
        if s is None:
            return None
        out.append(s)
    return tuple(out)


def parse(text: str) -> Tuple[List[Rule], List[Tuple[int, str]]]:
    """The ``[[stage]]`` rules of one file, and (line, problem) for what cannot be read."""
    rules: List[Rule] = []
    errors: List[Tuple[int, str]] = []
    cur: Optional[Dict[str, Any]] = None
    in_stage = False
    skip_until = ""  # closing delimiter of a multi-line string being skipped
    pending: Optional[Tuple[str, int, List[str]]] = None  # a multi-line array: key, line, parts
    engine_ok = True
    top = True  # before the first table header

    def close() -> None:
        if cur is None:
            return
        rid, stage, targets = cur.get("id"), cur.get("stage"), cur.get("targets")
        if isinstance(rid, str) and isinstance(stage, str) and isinstance(targets, tuple) and targets:
            rules.append((rid, stage, targets, cur.get("ready") or READY_NEVER, cur.get("until") or ()))
        else:
            errors.append((cur["line"], "a [[stage]] needs id, stage and targets"))

    for n, raw in enumerate(text.split("\n"), 1):
        line = raw.strip()
        if skip_until:
            if skip_until in line:
                skip_until = ""
            continue
        if pending is not None:
            pkey, at, parts = pending
            parts.append(_strip_comment(line))
            if parts[-1].endswith("]"):
                pending = None
                arr = _array(" ".join(parts))
                if cur is not None and pkey in ("targets", "until"):
                    if arr is None:
                        errors.append((at, "%s: not an array of plain strings" % pkey))
                    cur[pkey] = arr
            continue
        if not line or line[0] == "#":
            continue
        if line[0] == "[":
            top = False
            header = _strip_comment(line)
            if header == "[[stage]]":
                close()
                cur = {"line": n}
                in_stage = True
            elif header.startswith("[[stage."):
                in_stage = False  # a sub-table of the current rule (examples): its keys are not the rule's
            else:
                close()
                cur = None
                in_stage = False
            continue
        key, eq, value = line.partition("=")
        if not eq:
            continue
        key, value = key.strip(), value.strip()
        for delim in ('"""', "'''"):
            if value.startswith(delim) and value.count(delim) == 1:
                skip_until = delim
        if skip_until:
            continue
        value = _strip_comment(value)
        if top:
            if key == "engine_version":
                v = _string(value) or ""
                engine_ok = v.partition(".")[0] == str(ENGINE_MAJOR)
            continue
        if not in_stage or cur is None:
            continue
        if value.startswith("[") and not value.endswith("]"):
            pending = (key, n, [value])
            continue
        if key in ("id", "stage"):
            cur[key] = _string(value)
            if cur[key] is None:
                errors.append((n, "%s: not a plain string" % key))
        elif key in ("targets", "until"):
            cur[key] = _array(value)
            if cur[key] is None:
                errors.append((n, "%s: not an array of plain strings" % key))
        elif key == "ready":
            cur[key] = _READY_VALUES.get(value.replace("'", '"'), READY_NEVER)
            if value.replace("'", '"') not in _READY_VALUES:
                errors.append((n, 'ready: not true, false, "entry" or "helper"'))
    close()
    if not engine_ok:
        return [], [(1, "engine_version: not %d.x" % ENGINE_MAJOR)]
    return rules, errors


def builtin_path() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rules", "stages.toml")


def rule_files(env: Any = None) -> List[str]:
    """The shipped file, then ``*.toml`` of each rules directory, sorted by name."""
    env = os.environ if env is None else env
    files = [builtin_path()]
    raw = _env.get("INFERSIGHT_RULES_DIRS", env)
    dirs = [d for d in raw.replace(",", ":").split(":") if d] if raw is not None else [SITE_DIR]
    for d in dirs:
        try:
            names = sorted(n for n in os.listdir(d) if n.endswith(".toml"))
        except OSError:
            continue  # no such directory: nothing to add
        files.extend(os.path.join(d, n) for n in names)
    return files[:MAX_FILES]


def _read(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_BYTES or b"[[stage]]" not in data:
        return None  # too big, or no stage rules (an OOM rule file)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def load(paths: List[str]) -> Tuple[Dict[str, Dict[str, List[Spec]]], List[str]]:
    """module -> {qualname: [(stage, rule id, ready, role), ...]} over ``paths`` (a later rule for
    the same target replaces an earlier one; a target that ends other rules' waits keeps those
    too), and ``"path:line: problem"`` for what could not be read."""
    by_module: Dict[str, Dict[str, List[Spec]]] = {}
    problems: List[str] = []
    for path in paths:
        text = _read(path)
        if text is None:
            continue
        rules, errors = parse(text)
        problems.extend("%s:%d: %s" % (path, line, msg) for line, msg in errors)
        for rid, stage, targets, ready, until in rules:
            role = ROLE_WAIT if until else ROLE_CALL
            for target, spec in [(t, (stage, rid, ready, role)) for t in targets] + [
                    (t, (stage, rid, READY_NEVER, ROLE_UNTIL)) for t in until]:
                module, colon, qualname = target.partition(":")
                if colon and module and qualname:
                    specs = by_module.setdefault(module, {}).setdefault(qualname, [])
                    if spec[3] != ROLE_UNTIL:  # one stage per target: the later rule's
                        specs[:] = [s for s in specs if s[3] == ROLE_UNTIL]
                    specs.append(spec)
                else:
                    problems.append("%s: %s: target %r is not module:qualname" % (path, rid, target))
    return by_module, problems


# -- wrapping ------------------------------------------------------------------------------


def _note(key: str, item: str) -> None:
    items = _runtime.state().root_attrs.setdefault(key, [])
    if isinstance(items, list) and len(items) < MAX_LISTED and item not in items:
        items.append(item)


def _open(stage: str, rule: str, target: str, ready: str = READY_NEVER) -> Any:
    """Open the rule's stage (None: nothing collected, or a rule's span of this stage is open)."""
    try:
        opened = _open_stages.get()
        if stage in opened or not cs.state().collecting or not cs.root_open():
            return None
        o = cs.begin(stage, {_contract.STAGE_RULE: rule, "infersight.stage.target": target})
        awaits = ready == READY_AT_RETURN
        _readiness.rule_stage_opened(o.span, awaits)
        return o, _open_stages.set((*opened, stage)), awaits
    except Exception as exc:
        _runtime.fail(exc)
        return None


def _close(token: Any, err: Optional[BaseException], ready: str = READY_NEVER) -> None:
    o, reset, awaits = token
    try:
        _open_stages.reset(reset)
    except ValueError:
        pass  # reset in another context (a generator's frame moved): the stage still ends
    cs.end(o, err=err)
    if ready == READY_AT_RETURN and err is None and not _open_stages.get():
        # a rule that says the process is ready when its outermost call returns (Serve's
        # replica init, serve.run): readiness now, before its own sockets are taken as foreign
        _readiness.mark_ready("stage_rule", attrs={_contract.STAGE_RULE: o.attrs.get(_contract.STAGE_RULE, "")})
    _readiness.rule_stage_closed(awaits)


def _entered(rule: str, helper: bool = False) -> None:
    """A ``ready = "entry"`` rule's target was called: the process is ready (unless inside
    another rule's call: a loop run while a stage is still under way is not serving yet).
    ``ready = "helper"``: also a helper process from here (a multiprocessing manager's server
    loop serves its parent's shared objects, no request of its own)."""
    try:
        st = cs.state()
        if _open_stages.get() or not st.collecting or not cs.root_open():
            return
        if helper:
            st.role = _contract.ROLE_HELPER
        if st.ready_source == "fork" and st.ready_ns is not None:
            # a worker forked from a ready server (gunicorn's) enters its loop: its own work after
            # the fork is done; a worker killed later has its root ended there by the agent
            _readiness.fork_ready(attrs={_contract.STAGE_RULE: rule}, at_last_stage=True)
        else:
            _readiness.mark_ready("stage_rule", attrs={_contract.STAGE_RULE: rule})
    except Exception as exc:
        _runtime.fail(exc)


def _wait_begins(stage: str, rule: str, target: str, nest: bool) -> None:
    """A wait rule's target was called (a worker's task loop): its wait starts, once. ``nest`` (a coroutine
    target): the wait is its task's current span until it ends, so that the stages the task runs meanwhile
    (an ASGI app's lifespan startup, loading its model) nest in it; such a wait is also closed when the
    target returns first, or at the root's end (its stages need their parent)."""
    try:
        st = cs.state()  # a forked child's is new: a wait opened before the fork is not its own
        if rule in st.rule_waits or rule in st.rule_waits_done or not st.collecting or not cs.root_open():
            return
        prev = _runtime.current_span.get()
        span = _runtime.new_span_id()
        with st.lock:
            if rule in st.rule_waits or rule in st.rule_waits_done:
                return
            st.rule_waits[rule] = (stage, target, prev or _runtime.state().root_span_id, time.time_ns(), span,
                                   prev, nest)
        if nest:  # (the coroutine's task: its own context)
            cs.add_run_source(_flush_waits, _open_waits)
            cs.set_current(span)
    except Exception as exc:
        _runtime.fail(exc)


def _wait_ends(rule: str, until: str) -> None:
    """One of a wait rule's ``until`` targets was called (the first task arrived): the wait is a stage."""
    _close_wait(rule, {"infersight.stage.until": until}, time.time_ns())


def _wait_returned(rule: str) -> None:
    """A nesting wait's coroutine target returned or raised before any ``until`` call (an ASGI app whose lifespan
    failed): the wait ends there."""
    _close_wait(rule, {}, time.time_ns(), nested_only=True)


def _close_wait(rule: str, attrs: Dict[str, Any], end_ns: int, nested_only: bool = False) -> None:
    """Emit ``rule``'s open wait as a stage ending at ``end_ns``, with ``attrs``; in the task it nests in, the span
    current before it is current again."""
    try:
        st = cs.state()
        if rule not in st.rule_waits:  # (every later call of a wait's target: no lock taken)
            return
        with st.lock:
            w = st.rule_waits.get(rule)
            if w is None or (nested_only and not w[6]):
                return
            del st.rule_waits[rule]
            st.rule_waits_done.add(rule)
        stage, target, parent, start, span, prev, _nest = w
        if _runtime.current_span.get() == span:  # ended in the task it nests in: back to what was current
            cs.set_current(prev)
        if not st.collecting or not cs.root_open():
            return
        ready = _readiness.ready_end()
        if ready is not None and ready < end_ns:  # the root ends there: a wait closed since is cut at its end
            end_ns = max(start, ready)
        cs.emit_stage(stage, span, parent, start, end_ns,
                      {_contract.STAGE_RULE: rule, "infersight.stage.target": target, **attrs})
    except Exception as exc:
        _runtime.fail(exc)


def _flush_waits(end_ns: int, final: bool) -> None:
    """``_recorder``'s run source: at the root's end, a nesting wait still open (its ``until`` never came: a
    lifespan that failed without saying so) ends there, so that the stages inside it keep their parent."""
    if not final:
        return
    st = cs.state()
    with st.lock:
        open_rules = [rule for rule, w in st.rule_waits.items() if w[6]]
    for rule in open_rules:
        _close_wait(rule, {}, end_ns, nested_only=True)


def _open_waits() -> List[Tuple[str, str, str, int, int, Dict[str, Any]]]:
    """(Sampler thread) The nesting waits still open, as stages so far (for checkpoints)."""
    st = cs.state()
    now = time.time_ns()
    with st.lock:
        waits = [(rule, w) for rule, w in st.rule_waits.items() if w[6]]
    return [(w[0], w[4], w[2], w[3], now, {_contract.STAGE_RULE: rule, "infersight.stage.target": w[1]})
            for rule, w in waits]


def _before(fn: Callable[..., Any], hook: Callable[[], None]) -> Callable[..., Any]:
    """``fn`` that runs ``hook()`` first (a coroutine function: when its coroutine starts)."""
    if getattr(getattr(fn, "__code__", None), "co_flags", 0) & _CO_COROUTINE:
        async def abefore(*args: Any, **kwargs: Any) -> Any:
            hook()
            return await fn(*args, **kwargs)

        return abefore

    def before(*args: Any, **kwargs: Any) -> Any:
        hook()
        return fn(*args, **kwargs)

    return before


def wrap(fn: Callable[..., Any], stage: str, rule: str, target: str, ready: str = READY_NEVER,
         role: str = ROLE_CALL) -> Callable[..., Any]:
    """``fn`` whose calls are one stage each (a coroutine function: its await). A ``ready =
    "entry"`` rule's call marks readiness and opens no stage; a wait rule's target starts its
    wait and an ``until`` target ends it (neither is a stage itself)."""
    is_async = getattr(getattr(fn, "__code__", None), "co_flags", 0) & _CO_COROUTINE
    if role == ROLE_WAIT and is_async:
        async def await_wait(*args: Any, **kwargs: Any) -> Any:
            _wait_begins(stage, rule, target, True)
            try:
                return await fn(*args, **kwargs)
            finally:
                _wait_returned(rule)

        wrapper: Callable[..., Any] = await_wait
    elif role == ROLE_WAIT:
        wrapper = _before(fn, lambda: _wait_begins(stage, rule, target, False))
    elif role == ROLE_UNTIL:
        wrapper = _before(fn, lambda: _wait_ends(rule, target))
    elif ready in (READY_AT_ENTRY, READY_AS_HELPER):
        wrapper = _before(fn, lambda: _entered(rule, ready == READY_AS_HELPER))
    elif is_async:
        async def awrapper(*args: Any, **kwargs: Any) -> Any:
            token = _open(stage, rule, target, ready)
            if token is None:
                return await fn(*args, **kwargs)
            try:
                result = await fn(*args, **kwargs)
            except BaseException as e:
                _close(token, e)
                raise
            _close(token, None, ready)
            return result

        wrapper = awrapper
    else:
        def swrapper(*args: Any, **kwargs: Any) -> Any:
            token = _open(stage, rule, target, ready)
            if token is None:
                return fn(*args, **kwargs)
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:
                _close(token, e)
                raise
            _close(token, None, ready)
            return result

        wrapper = swrapper
    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        try:
            setattr(wrapper, attr, getattr(fn, attr))
        except (AttributeError, TypeError):
            pass
    try:
        wrapper.__dict__.update(getattr(fn, "__dict__", {}))  # a decorator's marks (ray's API tags)
    except (AttributeError, TypeError):
        pass
    # after the update: fn's own __wrapped__ (a decorator's) stays one level down
    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _wrappable(fn: Any) -> bool:
    code = getattr(fn, "__code__", None)
    return code is not None and not code.co_flags & _CO_GENERATORS


def apply(module: Any, qualname: str, stage: str, rule: str, ready: str = READY_NEVER, role: str = ROLE_CALL) -> bool:
    """Wrap ``module``'s ``qualname`` (True when done); the undo puts the original back."""
    parts = qualname.split(".")
    owner = module
    for part in parts[:-1]:
        owner = getattr(owner, part, None)
        if owner is None:
            return False
    name = parts[-1]
    target = "%s:%s" % (getattr(module, "__name__", "?"), qualname)
    raw: Any
    fn: Any
    if isinstance(owner, type):
        raw = owner.__dict__.get(name)
        kind = type(raw)
        fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
        if not _wrappable(fn):
            return False
        w = wrap(fn, stage, rule, target, ready, role)
        new: Any = kind(w) if kind in (classmethod, staticmethod) else w
    elif parts[:-1]:
        return False  # a method of something that is not a class
    else:
        raw = getattr(owner, name, None)
        if not _wrappable(raw):
            return False
        new = wrap(raw, stage, rule, target, ready, role)
    setattr(owner, name, new)

    def undo() -> None:
        current = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if current is new:
            setattr(owner, name, raw)

    cs.add_undo(undo)
    return True


def _installer(targets: Dict[str, List[Spec]]) -> Callable[[Any], None]:
    def install_module(module: Any) -> None:
        if not cs.state().collecting:
            return
        for qualname, specs in targets.items():
            # each wraps the one before; the ends of waits outermost, so that a wait this call ends
            # is over before the call's own stage or wait begins
            for stage, rule, ready, role in sorted(specs, key=lambda spec: spec[3] == ROLE_UNTIL):
                try:
                    done = apply(module, qualname, stage, rule, ready, role)
                except Exception:
                    done = False  # a library object we cannot wrap: name it, never fail the hooks
                if not done:
                    _note("infersight.stage_rules.missing", "%s:%s" % (getattr(module, "__name__", "?"), qualname))

    return install_module


def install(env: Any = None) -> None:
    """Watch every target's module (``$INFERSIGHT_STAGE_RULES=0``, or a helper process: none)."""
    env = os.environ if env is None else env
    if not _env.get("INFERSIGHT_STAGE_RULES", env):
        return
    if cs.state().role == "helper":
        return  # compile workers and probes print no waterfall: no rule file read either
    by_module, problems = load(rule_files(env))
    for p in problems[:MAX_LISTED]:
        _note("infersight.stage_rules.errors", p)
    for module, targets in by_module.items():
        cs.on_import(module, _installer(targets))
    main = _main_script_module(by_module)
    if main is not None:
        _watch_main_classes(main, by_module[main])


def _main_script_module(modules: Dict[str, Any]) -> Optional[str]:
    """The dotted name of the main script when rules name it: Ray runs its log monitor as
    ``python .../ray/_private/log_monitor.py``, so its classes live in ``__main__``, which is
    never imported."""
    import sys

    argv = getattr(sys, "argv", None) or [""]
    script = str(argv[0])
    if not script.endswith(".py") or not any(
            m.rpartition(".")[2] == os.path.basename(script)[:-3] for m in modules):
        return None  # cheap: no rule names a module of that file name
    path = os.path.realpath(script)
    for entry in sys.path:
        base = os.path.join(os.path.realpath(entry or "."), "")
        if path.startswith(base):
            name = path[len(base):-3].replace(os.sep, ".")
            if name in modules:
                return name
    return None


def _watch_main_classes(module: str, targets: Dict[str, List[Spec]]) -> None:
    """Apply ``module``'s rules to the classes the main script defines, as each is built (the
    script's own calls come right after: no import to wait for). ``builtins.__build_class__``
    is wrapped only in such a process, until every targeted class is built."""
    import builtins
    import types

    b: Any = builtins
    orig = b.__build_class__
    wanted = {q.split(".", 1)[0] for q in targets if "." in q}

    def build_class(func: Any, name: str, *bases: Any, **kw: Any) -> Any:
        cls = orig(func, name, *bases, **kw)
        try:
            if name in wanted and getattr(func, "__module__", None) == "__main__" and func.__qualname__ == name:
                wanted.discard(name)
                shim = types.SimpleNamespace(__name__=module)
                setattr(shim, name, cls)
                _installer({q: t for q, t in targets.items() if q.split(".", 1)[0] == name})(shim)
                if not wanted and b.__build_class__ is build_class:
                    b.__build_class__ = orig
        except Exception as exc:
            _runtime.fail(exc)
        return cls

    b.__build_class__ = build_class
    cs.add_undo(lambda: setattr(b, "__build_class__", orig) if b.__build_class__ is build_class else None)
