"""Which serving engine a command line starts, looking through the wrappers people put in front of it.

``infersight launch`` asks this before CMD runs: an engine is not held back and gets the OOM rules at
once (launch_base). A miss costs little (the default hold and the deferred rules: the engine's memory
errors are still classified, later); a false hit costs ~0.2 s of CPU in the cold start. So the reading is
conservative: a wrapper's options are skipped only where their arity is known, a package's tools are no
server, and anything unread answers None. Pure and stdlib only: launch imports it before CMD starts.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

# CMD's program, or the module after ``-m``, that starts a serving engine.
ENGINE_COMMANDS = frozenset({"text-generation-launcher", "llama-server", "trtllm-serve"})
# An engine only with their ``serve`` subcommand (``vllm bench``, ``lmdeploy lite``, ``text-generation-server
# download-weights`` are not).
ENGINE_SERVE = frozenset({"vllm", "lmdeploy", "ollama", "text-generation-server"})
# ``python -m vllm serve``: a CLI module, an engine only with its serve subcommand
MODULE_SERVE = frozenset({"vllm", "vllm.entrypoints.cli.main", "lmdeploy", "text_generation_server.cli"})
# The servers' own modules (``python -m sglang.launch_server``); a package's other modules are its tools
# (``sglang.check_env``, ``tensorrt_llm.commands.build``, ``vllm.collect_env``).
SERVER_MODULES = ("vllm.entrypoints", "sglang.launch_server", "sglang.srt.entrypoints", "lmdeploy.serve",
                  "llama_cpp.server", "tensorrt_llm.commands.serve", "text_generation_server.server")
MAX_ARGS = 4096
MAX_SCRIPT = 65536
SCRIPT_SEPARATORS = ";&|()\n"
SHELL_KEYWORDS = frozenset({"then", "do", "else", "elif", "if", "while", "until", "{", "!", "time"})

# Wrappers that run their first non-option argument: the options that take a separate value.
PREFIX_WRAPPERS: dict[str, frozenset[str]] = {
    "env": frozenset({"-u", "--unset", "-C", "--chdir"}),
    "nohup": frozenset(),
    "setsid": frozenset(),
    "exec": frozenset({"-a"}),
    "time": frozenset({"-o", "--output", "-f", "--format"}),
    "nice": frozenset({"-n", "--adjustment"}),
    "ionice": frozenset({"-c", "--class", "-n", "--classdata"}),
    "stdbuf": frozenset({"-i", "-o", "-e", "--input", "--output", "--error"}),
    "numactl": frozenset({"-N", "--cpunodebind", "-m", "--membind", "-C", "--physcpubind", "-i", "--interleave",
                          "-p", "--preferred"}),
    "sudo": frozenset({"-u", "--user", "-g", "--group", "-h", "--host", "-p", "--prompt", "-C", "--close-from",
                       "-D", "--chdir", "-r", "--role", "-t", "--type", "-U", "--other-user", "-T",
                       "--command-timeout"}),
    "doas": frozenset({"-u", "-C"}),
    "runuser": frozenset({"-u", "--user", "-g", "--group", "-G", "--supp-group"}),
    "mpirun": frozenset({"-n", "-np", "--np", "-c", "-N", "--npernode", "-npernode", "-H", "--host", "-host",
                         "--hostfile", "-hostfile", "--machinefile", "-machinefile", "-x", "--map-by", "-map-by",
                         "--bind-to", "-bind-to", "--rank-by", "--wdir", "-wdir", "--prefix", "-prefix",
                         "--output-filename"}),
    "srun": frozenset({"-n", "--ntasks", "-N", "--nodes", "-c", "--cpus-per-task", "-p", "--partition",
                       "-G", "--gpus", "-t", "--time", "-J", "--job-name", "-w", "--nodelist", "-A", "--account"}),
}
PREFIX_WRAPPERS["mpiexec"] = PREFIX_WRAPPERS["mpirun"]
# Wrappers with one argument of their own before the command: ``timeout 1h``, ``taskset -c 0-7``, ``chrt -f 10``.
POSITIONAL_WRAPPERS: dict[str, frozenset[str]] = {
    "timeout": frozenset({"-s", "--signal", "-k", "--kill-after"}),
    "taskset": frozenset(),
    "chrt": frozenset(),
}
TWO_VALUES = frozenset({"--mca", "-mca", "--gmca", "-gmca"})  # mpirun's ``--mca KEY VALUE``

# ``X run [options] CMD``: the project and environment runners, with their options that take a value.
RUN_WRAPPERS: dict[str, frozenset[str]] = {
    "uv": frozenset({"--with", "-w", "--with-editable", "--with-requirements", "--python", "-p", "--package",
                     "--extra", "--group", "--only-group", "--no-group", "--no-extra", "--index", "--index-url",
                     "--default-index", "--extra-index-url", "--find-links", "-f", "--env-file", "--directory",
                     "--project", "--config-file", "--cache-dir", "--python-platform", "--index-strategy",
                     "--keyring-provider", "--resolution", "--prerelease", "--exclude-newer", "--link-mode",
                     "--refresh-package", "--reinstall-package", "--upgrade-package", "-P", "--color"}),
    "poetry": frozenset({"-C", "--directory", "-P", "--project"}),
    "pipenv": frozenset(),
    "pdm": frozenset({"-p", "--project"}),
    "rye": frozenset({"--pyproject"}),
    "pixi": frozenset({"-e", "--environment", "--manifest-path"}),
    "hatch": frozenset(),
    "conda": frozenset({"-n", "--name", "-p", "--prefix", "--cwd"}),
}
RUN_WRAPPERS["mamba"] = RUN_WRAPPERS["micromamba"] = RUN_WRAPPERS["conda"]
UVX_VALUES = RUN_WRAPPERS["uv"] | frozenset({"--from"})  # ``uvx`` = ``uv tool run``

SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ash"})
SHELL_LONG_FLAGS = frozenset({"--login", "--noprofile", "--norc", "--posix"})
MAX_DEPTH = 6  # wrappers in wrappers: ``sudo -u svc env X=1 uv run vllm serve``


def engine_command(argv: Sequence[object]) -> str | None:
    """The serving engine a command line starts, by its program (``vllm serve``, ``llama-server``,
    ``text-generation-launcher``) or the module of ``python -m`` (``python -m sglang.launch_server``,
    before the script's own arguments), also behind wrappers (``env``, ``uv run``, ``conda run``, ``sudo``,
    ``mpirun``, ``sh -c "..."``); None if none. Never raises: a command line this cannot read is no engine."""
    try:
        return _engine([str(a) for a in list(argv)[:MAX_ARGS]], 0)
    except Exception:  # a malformed argv must not stop launch
        return None


def _engine(argv: list[str], depth: int) -> str | None:
    if not argv or depth > MAX_DEPTH:
        return None
    prog = os.path.basename(argv[0])
    if prog in ENGINE_COMMANDS or (prog in ENGINE_SERVE and len(argv) > 1 and argv[1] == "serve"):
        return prog
    if prog.startswith("python"):
        return _python_module(argv)
    if prog in SHELLS:
        return _shell_string(argv, depth)
    inner = _unwrapped(prog, argv)
    return _engine(inner, depth + 1) if inner else None


def _assignment(word: str) -> bool:
    """``NAME=VALUE``, as ``env`` and a shell read it before the command."""
    name, eq, _ = word.partition("=")
    return bool(eq) and bool(name) and not name[0].isdigit() and all(c.isalnum() or c == "_" for c in name)


def _python_module(argv: Sequence[str]) -> str | None:
    for i, a in enumerate(argv[1:64], 1):
        if a == "-m" and i + 1 < len(argv):
            mod = argv[i + 1]
            if mod in MODULE_SERVE:  # ``python -m vllm serve``: the CLI, an engine only with its serve subcommand
                return mod if i + 2 < len(argv) and argv[i + 2] == "serve" else None
            return mod if mod.startswith(SERVER_MODULES) and "bench" not in mod else None
        if a == "-c" or not a.startswith("-"):
            return None  # code, or the script: what follows is its own
    return None


def _unwrapped(prog: str, argv: Sequence[str]) -> list[str] | None:
    """The command a wrapper runs, or None where ``prog`` is no wrapper this reads."""
    if prog in PREFIX_WRAPPERS:
        return _after_options(argv[1:], PREFIX_WRAPPERS[prog], assignments=prog in ("env", "sudo"))
    if prog in POSITIONAL_WRAPPERS:
        rest = _after_options(argv[1:], POSITIONAL_WRAPPERS[prog])
        return rest[1:] if rest else None
    if prog in RUN_WRAPPERS and len(argv) > 1 and argv[1] == "run":
        return _after_options(argv[2:], RUN_WRAPPERS[prog])
    if prog == "uvx":
        return _after_options(argv[1:], UVX_VALUES)
    if prog == "uv" and list(argv[1:3]) == ["tool", "run"]:
        return _after_options(argv[3:], UVX_VALUES)
    return None


def _after_options(args: Sequence[str], takes_value: frozenset[str], assignments: bool = False) -> list[str] | None:
    i = 0
    while i < len(args):
        a = str(args[i])
        if a == "--":
            return [str(x) for x in args[i + 1:]]
        if a.startswith("-") and len(a) > 1:
            if "=" in a:
                i += 1
            elif a in TWO_VALUES:
                i += 3
            else:
                i += 2 if a in takes_value else 1
            continue
        if assignments and _assignment(a):
            i += 1
            continue
        return [str(x) for x in args[i:]]
    return None


def _shell_string(argv: Sequence[str], depth: int) -> str | None:
    """``sh -c "pip install x && exec vllm serve m"``: each simple command of the string, in order."""
    i = 1
    while i < min(len(argv), 16):
        a = argv[i]
        if a in SHELL_LONG_FLAGS:
            i += 1
            continue
        if a in ("-o", "+o"):  # ``bash -o pipefail -c ...``
            i += 2
            continue
        if a[:1] not in ("-", "+") or a.startswith("--"):
            return None  # a script file, or an option this does not read
        if a[0] == "-" and "c" in a[1:]:
            return _in_script(argv[i + 1], depth) if i + 1 < len(argv) else None
        i += 1
    return None


def _in_script(script: str, depth: int) -> str | None:
    import shlex

    lexer = shlex.shlex(script[:MAX_SCRIPT], posix=True, punctuation_chars=SCRIPT_SEPARATORS)
    lexer.whitespace = " \t\r"  # a newline separates commands, as ; does
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # an unbalanced quote: the shell refuses it too
        return None
    command: list[str] = []
    for token in [*tokens, ";"]:
        if token and set(token) <= set(SCRIPT_SEPARATORS):
            while command and (_assignment(command[0]) or command[0] in SHELL_KEYWORDS):
                command.pop(0)
            found = _engine(command, depth + 1)
            if found is not None:
                return found
            command = []
        else:
            command.append(token)
    return None
