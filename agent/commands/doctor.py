"""``infersight doctor``: what works on this host, what does not, and the fix for each.

Exit 0 when ``launch`` can run here. A missing GPU, NVML or torch, an absent daemon
and an unreachable exporter are warnings: they limit a feature, not ``launch``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.parse
from dataclasses import asdict, dataclass
from typing import Any, TextIO

from infersight import __version__
from infersight.agent.cli import EXIT_USAGE, command_help
from infersight.agent.commands.compose import otlp_requested
from infersight.agent.daemon import config as cfg
from infersight.bytesize import human_bytes
from infersight.hooks import _bootstrap_dir, _paths
from infersight.redact import mask_url
from infersight.settings import Config, ConfigError

OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


def check_python() -> Check:
    v = sys.version_info
    if v < (3, 10):
        return Check("python", FAIL, platform.python_version(), "the agent needs Python >= 3.10")
    return Check("python", OK, "%s (%s)" % (platform.python_version(), sys.executable))


# What check_torch reads, in this interpreter or in another one (``--python``: it prints one JSON line):
# torch's version, its CUDA build and devices; None without torch. One source for both.
_TORCH_FACTS = """\
def torch_facts():
    try:
        import torch
    except ImportError:
        return None
    out = {"version": torch.__version__, "cuda": getattr(torch.version, "cuda", None), "n": 0, "why": "",
           "init": False}
    if out["cuda"]:
        try:
            out["n"] = torch.cuda.device_count()
            out["init"] = bool(torch.cuda.is_initialized())
        except Exception as exc:
            out["why"] = str(exc)
    return out
"""


def _torch_facts(python: str | None) -> dict[str, Any] | None:
    """``_TORCH_FACTS`` run here (``python`` None) or in ``python``. Raises OSError/ValueError when
    ``python`` does not answer."""
    if python is None:
        ns: dict[str, Any] = {}
        exec(_TORCH_FACTS, ns)  # noqa: S102 - our own source, above
        facts: dict[str, Any] | None = ns["torch_facts"]()
        return facts
    probe = _TORCH_FACTS + "import json\nprint(json.dumps(torch_facts()))\n"
    r = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    if r.returncode != 0:
        raise ValueError((r.stderr.strip().splitlines() or ["exit status %d" % r.returncode])[-1])
    lines = r.stdout.strip().splitlines()
    answer = json.loads(lines[-1]) if lines else None
    if answer is not None and not isinstance(answer, dict):
        raise ValueError("unexpected answer %r" % lines[-1])
    return answer


def check_torch(python: str | None = None) -> list[Check]:
    """torch and CUDA in this interpreter, or in ``python`` (the model server's: ``--python``)."""
    where = "this interpreter" if python is None else python
    try:
        facts = _torch_facts(python)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        return [Check("torch", WARN, "cannot run %s: %s" % (python, exc), "pass the model server's interpreter "
                      "to --python (its venv's bin/python)")]
    if facts is None:
        if python is None:
            return [Check("torch", WARN, "not installed in this interpreter (the agent needs none)",
                          "the model server's interpreter needs it, not the agent's: check there with "
                          "`infersight doctor --python <its python>`; launch still traces any Python process")]
        return [Check("torch", WARN, "not installed in %s" % where,
                      "install torch there if it serves models on GPUs; launch still traces any Python process")]
    out = [Check("torch", OK, "torch %s%s" % (facts["version"], "" if python is None else " in %s" % python))]
    cuda = facts.get("cuda")
    if not cuda:
        out.append(Check("cuda", WARN, "torch is a CPU build: CUDA is not compiled in",
                         "install a CUDA build of torch on GPU hosts"))
    elif facts.get("n"):
        out.append(Check("cuda", OK, "CUDA %s compiled in, %d device(s), initialised here: %s"
                         % (cuda, facts["n"], facts.get("init"))))
    else:
        out.append(Check("cuda", WARN, "CUDA %s compiled in, but %s" % (cuda, facts.get("why") or "no device visible"),
                         "check the driver and CUDA_VISIBLE_DEVICES"))
    return out


NVML_WAIT_S = 10.0  # nvmlInit takes seconds on a large host without persistence mode; a hung driver, for ever


def check_nvml() -> Check:
    import threading

    from infersight.agent.devices.nvml import Nvml, NvmlStatus

    got: list[NvmlStatus | BaseException] = []

    def ask() -> None:  # on a daemon thread: a driver that does not answer must not hold doctor (nor its exit)
        try:
            nv = Nvml()
            try:
                got.append(nv.status())
            finally:
                nv.close()
        except Exception as exc:  # (the wrapper does not raise: said as what it is if it does)
            got.append(exc)

    t = threading.Thread(target=ask, name="doctor-nvml", daemon=True)
    t.start()
    t.join(NVML_WAIT_S)
    if not got:
        return Check("nvml", WARN, "NVML did not answer within %.0f s (nvmlInit): a driver that stopped answering"
                     % NVML_WAIT_S, "look for Xid errors in the kernel log (dmesg) and run nvidia-smi; the agent "
                     "goes on without device samples meanwhile")
    st = got[0]
    if isinstance(st, BaseException):
        return Check("nvml", WARN, "NVML failed: %s: %s" % (type(st).__name__, st),
                     "device metrics and verdicts need NVML; the agent goes on without it")
    if st.available:
        return Check("nvml", OK, "driver %s, %d device(s)" % (st.driver_version, st.device_count))
    return Check("nvml", WARN, "absent: %s" % st.reason,
                 "install the NVIDIA driver (libnvidia-ml.so.1); device metrics and verdicts need it")


def _denied(path: str, exc: OSError) -> Check:
    """This user may not reach the socket at ``path``: who it is, the group it lacks, and how to join.
    The group is the owning group of the first path in the way (the socket's directory, 0750
    infersight:infersight from tmpfiles.d, or the 0660 socket), else of the socket's directory."""
    import grp
    import pwd

    uid = os.getuid()
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    gid = None
    probe = os.path.dirname(os.path.abspath(path))
    for p in _above(path):  # the first one this process may not search (or, last, the socket itself)
        try:
            st = os.stat(p)
        except OSError:
            break
        gid = st.st_gid
        probe = p
        if p != path and not os.access(p, os.X_OK):
            break
    try:
        group = grp.getgrgid(gid).gr_name if gid is not None else "infersight"
    except KeyError:
        group = str(gid)
    if gid is not None and gid in (os.getgid(), *os.getgroups()):
        return Check("agent", WARN, "permission denied for uid %d (%s) at %s: %s" % (uid, user, path, exc),
                     "%s is in group %s already: check the modes of %s and the socket" % (user, group, probe))
    member = gid is not None and user in _members(gid)
    why = ("a member of group %s since this process started: log in again" % group if member
           else "not in group %s" % group)
    return Check("agent", WARN, "the socket %s exists, but permission denied for uid %d (%s, %s)"
                 % (path, uid, user, why),
                 "usermod -aG %s %s, then restart its processes (a service: SupplementaryGroups=%s)"
                 % (group, user, group))


def _above(path: str) -> list[str]:
    """``path``'s directories from ``/`` down, then ``path``."""
    path = os.path.abspath(path)
    out = [path]
    while path != os.path.dirname(path):
        path = os.path.dirname(path)
        out.append(path)
    return out[::-1]


def _members(gid: int) -> set[str]:
    """The users whose group ``gid`` is, supplementary or primary."""
    import grp
    import pwd

    try:
        members = set(grp.getgrgid(gid).gr_mem)
    except KeyError:
        members = set()
    return members | {pw.pw_name for pw in pwd.getpwall() if pw.pw_gid == gid}


def check_socket(conf: Config) -> list[Check]:
    path = conf["agent.socket"]
    out = []
    try:
        st = os.stat(path)
    except PermissionError as exc:  # os.path.exists says False here: the socket is there, in a closed directory
        return [_denied(path, exc)]
    except OSError:
        st = None
    if st is not None:
        mode = st.st_mode & 0o777
        status = OK if mode & 0o007 == 0 else WARN
        out.append(Check("socket", status, "%s (mode %04o)" % (path, mode),
                         "" if status == OK else "the socket should be 0660 or stricter"))
        try:
            from infersight.agent.commands.status import query_status

            h = query_status(path, 2.0)
            state = "healthy" if h.get("healthy") else "unhealthy"
            out.append(Check("agent", OK if h.get("healthy") else WARN,
                             "running (pid %s, %s)" % (h.get("pid"), state),
                             "" if h.get("healthy") else "see `infersight status`"))
        except PermissionError as exc:  # a 0660 socket and a user not in its group
            out.append(_denied(path, exc))
        except OSError as exc:
            out.append(Check("agent", WARN, "not answering at %s: %s" % (path, exc),
                             "start it (systemctl start infersight) or use `infersight launch`"))
    else:
        out.append(Check("agent", WARN, "no daemon socket at %s" % path,
                         "optional: `infersight launch` runs its own agent; install the service for fleets"))
    return out


def _tcp_reachable(host: str, port: int) -> str | None:
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return None
    except OSError as exc:
        return str(exc)


def check_exporters(conf: Config) -> list[Check]:
    out = []
    endpoint = conf.get("exporters.otlp.endpoint")
    if not otlp_requested(conf, os.environ):
        out.append(Check("otlp", OK, "not configured (no OTEL_EXPORTER_OTLP_*ENDPOINT, or OTEL_SDK_DISABLED=true): "
                         "file output only"))
    elif endpoint:
        u = urllib.parse.urlsplit(endpoint if "://" in endpoint else "http://" + endpoint)
        port = u.port or (443 if u.scheme == "https" else 4318)
        err = _tcp_reachable(u.hostname or "127.0.0.1", port)
        out.append(Check("otlp", OK if err is None else WARN,
                         "%s %s" % (mask_url(endpoint), "reachable" if err is None else "unreachable: " + err),
                         "" if err is None else "start the collector or fix OTEL_EXPORTER_OTLP_ENDPOINT; "
                         "the agent spools until it is back"))
    else:
        out.append(Check("otlp", OK, "per-signal endpoints (OTEL_EXPORTER_OTLP_<SIGNAL>_ENDPOINT), not probed"))
    mqtt = os.environ.get("INFERSIGHT_MQTT_URL") or conf.get("exporters.mqtt.url")
    if mqtt:
        u = urllib.parse.urlsplit(str(mqtt))
        port = u.port or (8883 if u.scheme == "mqtts" else 1883)
        err = _tcp_reachable(u.hostname or "127.0.0.1", port)
        out.append(Check("mqtt", OK if err is None else WARN,
                         "%s %s" % (mask_url(str(mqtt)), "reachable" if err is None else "unreachable: " + err),
                         "" if err is None else "start the broker or fix INFERSIGHT_MQTT_URL"))
    return out


def check_spool(conf: Config) -> Check:
    d = conf["agent.spool_dir"]
    probe = d
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:
        usage = shutil.disk_usage(probe or "/")
    except OSError as exc:
        return Check("spool", WARN, "%s: %s" % (d, exc), "set INFERSIGHT_SPOOL_DIR to a writable directory")
    writable = os.access(probe or "/", os.W_OK)
    free_mib = usage.free // 2**20
    status = OK if writable and free_mib >= 128 else WARN
    return Check("spool", status, "%s (%s, %d MiB free)" % (d, "writable" if writable else "NOT writable", free_mib),
                 "" if status == OK else "point INFERSIGHT_SPOOL_DIR at a writable directory with space")


def check_storage_ceiling() -> Check:
    """The sequential-read ceiling of the storage under the current directory (cached)."""
    from infersight.agent.coldstart import storage_ceiling as sc

    here = os.getcwd()
    try:
        entry = sc.lookup(here)
        if entry is None and os.access(here, os.W_OK):
            entry = sc.measure_dir(here, size=128 << 20)  # bounded: one 128 MiB scratch file
    except OSError as exc:
        return Check("storage", WARN, "could not measure the read ceiling of %s: %s" % (here, exc),
                     "run doctor from the directory that holds the weights")
    if entry is None:
        return Check("storage", WARN, "read ceiling of %s not measured (directory not writable)" % here,
                     "run doctor from a writable directory on the weights' disk")
    return Check("storage", OK, "device %s reads %s/s sequentially (%s read, cached in %s)" % (
        entry.get("device"), human_bytes(float(entry.get("bytes_per_s", 0))), entry.get("method"), sc.cache_path()))


def check_allocator() -> Check:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
    if conf:
        return Check("allocator", OK, "PYTORCH_(CUDA_)ALLOC_CONF=%s" % conf)
    return Check("allocator", OK, "defaults (no PYTORCH_CUDA_ALLOC_CONF); "
                 "expandable_segments:True helps against fragmentation OOMs")


def check_launch(python: str | None = None) -> Check:
    """The hooks activate from infersight's own install (through PYTHONPATH, as ``launch`` sets
    it) in this interpreter, or in ``python``, where infersight need not be installed."""
    boot = _bootstrap_dir()
    if not os.path.isfile(os.path.join(boot, "sitecustomize.py")):
        return Check("launch", FAIL, "bootstrap missing at %s" % boot, "reinstall infersight")
    d = tempfile.mkdtemp(prefix="infersight-doctor-")
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(os.path.join(d, "t.sock"))
        s.close()
        env = dict(os.environ, PYTHONPATH=boot, INFERSIGHT_SOCKET=os.path.join(d, "none.sock"),
                   INFERSIGHT_SPOOL_DIR=os.path.join(d, "spool"), INFERSIGHT_EXIT_FLUSH_S="0.1")
        try:
            r = subprocess.run([python or sys.executable, "-c", "import infersight.hooks as h; print(h.active())"],
                               capture_output=True, text=True, env=env, timeout=30, check=False)
        except OSError as exc:
            return Check("launch", FAIL, "cannot run %s: %s" % (python or sys.executable, exc),
                         "pass the model server's interpreter to --python (its venv's bin/python)")
        if r.stdout.strip() != "True":
            return Check("launch", FAIL, "hooks did not activate: %s" % (r.stderr.strip()[-200:]),
                         "report this with `infersight doctor --json`")
    except OSError as exc:
        return Check("launch", FAIL, "cannot create a private socket: %s" % exc, "check TMPDIR permissions")
    finally:
        shutil.rmtree(d, ignore_errors=True)
    if python is not None:  # they did here, as doctor's user: the server's user may not read them
        from infersight.agent.commands import hooks_install

        try:
            site = hooks_install.site_packages(python)
        except (OSError, ValueError, subprocess.SubprocessError):
            site = None
        problem = hooks_install.access_problem(site, boot) if site else None
        if problem is not None:
            return Check("launch", WARN, "hooks activate through %s in %s as uid %d, but %s"
                         % (boot, python, os.getuid(), problem[0]), problem[1])
    return Check("launch", OK, "hooks activate through %s%s" % (boot, " in %s" % python if python else ""))


def check_pth(python: str | None = None) -> Check:
    """The ``.pth`` line that ``hooks install`` wrote into the site-packages of ``python`` (else of this
    interpreter) is the one this infersight writes. An upgrade replaces infersight's files, not that line: an
    older one runs the new bootstrap, but without what the line itself does (the misspelled switch said, one
    explained line instead of a traceback when infersight's files are gone)."""
    from infersight.agent.commands import hooks_install

    again = "infersight hooks install%s" % ("" if python is None else " --python %s" % shlex.quote(python))
    try:
        site = hooks_install.site_packages(python or sys.executable)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        return Check("pth", WARN, "cannot ask %s for its site-packages: %s" % (python or sys.executable, exc),
                     "pass the model server's interpreter to --python (its venv's bin/python)")
    path = os.path.join(site, hooks_install.PTH_NAME)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            line = f.read()
    except FileNotFoundError:
        return Check("pth", OK, "no %s in %s: INFERSIGHT=1 starts no hooks there (launch does not need it)"
                     % (hooks_install.PTH_NAME, site))
    except OSError as exc:
        return Check("pth", WARN, "cannot read %s: %s" % (path, exc), "run doctor as a user who may read it")
    boot = _bootstrap_dir()
    if line == hooks_install.pth_line(boot):
        return Check("pth", OK, "%s: the line this infersight writes (INFERSIGHT=1 starts the hooks)" % path)
    if repr(boot) not in line:  # (every version's line names its bootstrap directory so)
        return Check("pth", WARN, "the .pth line in %s runs the hooks of another infersight install, not this "
                     "one's (%s)" % (path, boot), "to run this one's: %s" % again)
    return Check("pth", WARN, "the .pth line in %s is from an older infersight: run %s again" % (path, again), again)


def run_doctor(out: TextIO, as_json: bool = False, python: str | None = None) -> int:
    """``python``: the model server's interpreter, where the torch/CUDA and hooks checks run."""
    logging.getLogger("infersight").setLevel(logging.ERROR)  # findings go in the table, once
    try:
        conf = cfg.load(os.environ.get("INFERSIGHT_CONFIG") or cfg.DEFAULT_CONFIG_PATH)
    except ConfigError as exc:
        conf = cfg.load(None)
        bad = Check("config", WARN, str(exc), "fix the config file; the agent refuses to start with it")
    else:
        bad = Check("config", OK, conf.path or "no config file: defaults and environment")
    checks = [check_python(), check_launch(python), check_pth(python), bad, *check_torch(python), check_nvml(),
              *check_socket(conf), *check_exporters(conf), check_spool(conf), check_storage_ceiling(),
              check_allocator()]
    failed = any(c.status == FAIL for c in checks)
    if as_json:
        out.write(json.dumps({"version": __version__, "launch_ok": not failed,
                              "socket": _paths.socket_path(), "checks": [asdict(c) for c in checks]}) + "\n")
    else:
        out.write("infersight %s doctor\n" % __version__)
        for c in checks:
            out.write("  %-5s %-10s %s\n" % (c.status, c.name, c.detail))
            if c.fix and c.status != OK:
                out.write("  %-5s %-10s fix: %s\n" % ("", "", c.fix))
        out.write("launch can run here.\n" if not failed else "launch cannot run here: see FAIL above.\n")
    return 1 if failed else 0


def add_parser(sub: Any, help_line: str | None = None) -> argparse.ArgumentParser:
    dp: argparse.ArgumentParser = sub.add_parser("doctor", help=help_line or command_help("doctor"))
    dp.add_argument("--json", action="store_true")
    dp.add_argument("--python", metavar="PATH",
                    help="the model server's interpreter: check torch, CUDA and the hooks there "
                         "(infersight need not be installed in it)")
    dp.set_defaults(func=run)
    return dp


def run(args: argparse.Namespace) -> int:
    from infersight.agent.commands.doctor import run_doctor

    python = getattr(args, "python", None)
    if python is not None:
        found = shutil.which(python)
        if found is None:
            sys.stderr.write("infersight doctor: --python %s: not an executable\n" % python)
            return EXIT_USAGE
        python = os.path.abspath(found)
    return run_doctor(sys.stdout, as_json=args.json, python=python)
