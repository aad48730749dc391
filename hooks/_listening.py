"""Readiness from the kernel: a listening socket that a process owns (stdlib only).

A server whose socket is opened in C (uvloop, a non-Python CMD under ``launch``) never calls
``socket.socket.listen``. The kernel still lists its socket: ``/proc/<pid>/net/tcp``,
``tcp6`` (state ``0A``, LISTEN) and ``unix`` (flag ``__SO_ACCEPTCON``), each line with the
socket's inode, and ``/proc/<pid>/fd`` links ``socket:[inode]`` for the sockets the process
holds. :class:`ListenWatch` polls those tables (the cold-start sampler's thread in a hooked
process, the launcher for a non-Python CMD): a poll reads the tables, and reads the process's
descriptors only when a listening inode it has not seen yet appears (listening sockets of
other processes in the same network namespace are remembered as foreign).

The same tables come cheaper through ``sock_diag`` netlink, which filters on the LISTEN
state in the kernel: ``/proc/net/tcp`` lists every connection of the namespace (a host with
a thousand TIME_WAIT sockets makes it a 2 ms read), the dump only the listeners. The
``/proc`` files are the fallback where netlink is refused (seccomp, old kernels), and for a
process in another network namespace (sock_diag answers for the watcher's own only).

Not readiness: a ``torch.distributed`` store on ``MASTER_PORT``, multiprocessing's sockets
(``pymp-`` directories), abstract unix names, and a socket that starts listening inside a
stage rule's call (Ray's core worker RPC server inside ``ray.init``: ``ListenWatch.absorb``), and a
side server's socket (a metrics exporter's: ``_sideservers``, ``side``).

Nor, from the tables alone, a socket the process shares: one it held when its hooks started
(``inherited``: a supervisor's bound socket that a ``uvicorn --workers`` worker gets at spawn,
systemd's) or one its parent holds too (a forked child's copy: LitServe's processes). The
kernel shows such an inode LISTEN, and held by this process, as soon as *any* of its holders
listens: a sibling's listen would make a worker still loading its model "ready". It counts
only once this process says it serves on it (``ListenWatch.claim``: uvicorn's
``Server.startup`` returned), and ``absorb`` never takes it as foreign.
"""

from __future__ import annotations

import os
import struct
import time

TYPE_CHECKING = False  # the typing module costs ~10 ms at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple, Union

    Found = Tuple[str, Union[int, str]]  # ("tcp", port) or ("unix", path)

TCP_LISTEN = "0A"
SO_ACCEPTCON = 0x10000
MAX_TABLE_BYTES = 4 << 20  # a host with very many sockets: read this much of a table at most


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(MAX_TABLE_BYTES).decode("ascii", "replace")
    except OSError:
        return ""


def tcp_listeners(text: str) -> List[Tuple[int, int, int]]:
    """(port, uid, inode) of each LISTEN line of a ``/proc/net/tcp{,6}`` table."""
    out: List[Tuple[int, int, int]] = []
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 10 or f[3] != TCP_LISTEN:
            continue
        try:
            out.append((int(f[1].rsplit(":", 1)[1], 16), int(f[7]), int(f[9])))
        except (IndexError, ValueError):
            continue
    return out


def tcp_listening(text: str, skip_ports: Iterable[int] = ()) -> Dict[int, Found]:
    """inode -> ("tcp", port) for the LISTEN lines of a ``/proc/net/tcp{,6}`` table."""
    return {inode: ("tcp", port) for port, _uid, inode in tcp_listeners(text) if inode and port not in skip_ports}


def listeners_by_port(pid: int, proc_root: str = "/proc") -> Optional[Dict[int, Set[int]]]:
    """Every listening TCP port in ``pid``'s network namespace -> the uids owning a socket on it
    (one read of ``/proc/<pid>/net/tcp{,6}`` for all ports); None when neither table can be read."""
    texts = [_read("%s/%d/net/%s" % (proc_root, pid, name)) for name in ("tcp", "tcp6")]
    if not any(texts):
        return None
    out: Dict[int, Set[int]] = {}
    for text in texts:
        for p, uid, _inode in tcp_listeners(text):
            out.setdefault(p, set()).add(uid)
    return out


def listener_uids(pid: int, port: int, proc_root: str = "/proc") -> Optional[Set[int]]:
    """The uids owning a socket that listens on TCP ``port`` in ``pid``'s network namespace
    (``/proc/<pid>/net/tcp{,6}``); None when neither table can be read."""
    texts = [_read("%s/%d/net/%s" % (proc_root, pid, name)) for name in ("tcp", "tcp6")]
    if not any(texts):
        return None
    return {uid for text in texts for p, uid, _inode in tcp_listeners(text) if p == port}


def unix_listening(text: str) -> Dict[int, Found]:
    """inode -> ("unix", path) for the listening, named sockets of a ``/proc/net/unix`` table."""
    out: Dict[int, Found] = {}
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 8:
            continue  # no path: an unnamed socket
        try:
            flags, inode = int(f[3], 16), int(f[6])
        except ValueError:
            continue
        path = " ".join(f[7:])
        if flags & SO_ACCEPTCON and inode and not path.startswith("@") and "/pymp-" not in path:
            out[inode] = ("unix", path)
    return out


AF_INET, AF_INET6, AF_UNIX, AF_NETLINK = 2, 10, 1, 16
NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY = 4, 20
NLM_F_REQUEST_DUMP = 0x1 | 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
LISTEN_STATE = 10  # TCP_LISTEN; unix sockets use the same number
UDIAG_SHOW_NAME = 1
_HDR = struct.Struct("=IHHII")


def _dump(sock: object, family: int, request: bytes, seq: int) -> List[bytes]:
    """The payloads of one sock_diag dump (raises OSError)."""
    s = sock  # an _socket.socket
    s.send(_HDR.pack(_HDR.size + len(request), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST_DUMP, seq, 0) + request)  # type: ignore[attr-defined]
    out: List[bytes] = []
    while True:
        data = s.recv(1 << 16)  # type: ignore[attr-defined]
        if not data:
            return out
        off = 0
        while off + _HDR.size <= len(data):
            length, kind, _flags, mseq, _pid = _HDR.unpack_from(data, off)
            if length < _HDR.size:
                return out
            if mseq != seq:  # a reply to an earlier, abandoned dump: not ours
                off += (length + 3) & ~3
                continue
            if kind == NLMSG_DONE:
                return out
            if kind == NLMSG_ERROR:
                raise OSError("sock_diag refused the dump of family %d" % family)
            out.append(data[off + _HDR.size:off + length])
            off += (length + 3) & ~3


class _Netlink:
    """The process's one sock_diag socket, kept between polls: making and closing one per
    poll was four of its system calls (socket, non-blocking, connect, close), and each
    system call on a hooks thread costs a busy main thread a switch to hand the GIL back.
    A forked child makes its own (the inherited one is the parent's: their dumps would mix);
    a dump that fails drops it (a half-read dump would be left in it)."""

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()
        self.sock: Optional[Any] = None
        self.pid = 0
        self.ino = 0  # its inode: the number may be the host's after it closed ours (closerange)
        self.seq = 0
        self.made = 0  # sockets made (tests)

    def get(self) -> Any:
        """(Holding ``lock``) the socket, made here when missing or inherited across a fork."""
        pid = os.getpid()
        if self.sock is not None and (self.pid != pid or not _same(self.sock.fileno(), self.ino)):
            self._drop()  # our copy of the parent's descriptor (closing it leaves the parent's open), or gone
        if self.sock is None:
            import _socket

            sock = _socket.socket(AF_NETLINK, _socket.SOCK_DGRAM | getattr(_socket, "SOCK_CLOEXEC", 0),
                                  NETLINK_SOCK_DIAG)
            try:
                # Non-blocking: the kernel queues each part of a dump within the send or the
                # receive before it (never a wait), and a timeout would add a poll() before
                # every receive (a blocked receive raises: the /proc files are read instead).
                sock.setblocking(False)
                sock.connect((0, 0))
            except OSError:
                sock.close()
                raise
            self.sock, self.pid, self.ino = sock, pid, os.fstat(sock.fileno()).st_ino
            self.made += 1
        return self.sock

    def _drop(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            try:
                if _same(sock.fileno(), self.ino):
                    sock.close()
                else:
                    sock.detach()  # the host closed ours; the number is its own now: never closed here
            except OSError:
                pass

    def close(self) -> None:
        with self.lock:
            self._drop()

    def next_seq(self) -> int:
        self.seq = self.seq % 0x7FFFFFFF + 1
        return self.seq


def _same(fd: int, ino: int) -> bool:
    """``fd`` is still the descriptor opened with inode ``ino`` (not the host's own since it
    closed ours and the number was reused: one ``fstat``)."""
    try:
        return os.fstat(fd).st_ino == ino
    except OSError:
        return False


_netlink = _Netlink()


def _after_fork_child() -> None:
    """The parent's sampler thread may have held the lock at the fork (mid-dump): that
    thread is not in the child, which would wait for it forever."""
    import threading

    _netlink.lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_child)


def close_netlink() -> None:
    """Close the kept sock_diag socket and counter files (the cold start's polls are over); a
    later poll opens them again."""
    _netlink.close()
    while _gates:
        _gates.pop().close()


def netlink_listening(unix: bool = True, skip_ports: Iterable[int] = ()) -> Dict[int, Found]:
    """inode -> found, for the listening sockets of this network namespace (sock_diag)."""
    nl = _netlink
    with nl.lock:
        sock = nl.get()
        try:
            return _netlink_dumps(sock, nl, unix, skip_ports)
        except Exception:
            nl._drop()  # whatever is left of the dump in it would be read by the next one
            raise


def _netlink_dumps(sock: Any, nl: _Netlink, unix: bool, skip_ports: Iterable[int]) -> Dict[int, Found]:
    out: Dict[int, Found] = {}
    for family in (AF_INET, AF_INET6):
        req = struct.pack("=BBBBI48x", family, 6, 0, 0, 1 << LISTEN_STATE)  # IPPROTO_TCP, any address
        for msg in _dump(sock, family, req, nl.next_seq()):
            if len(msg) >= 72:
                port = struct.unpack_from("!H", msg, 4)[0]
                inode = struct.unpack_from("=I", msg, 68)[0]
                if inode and port not in skip_ports:
                    out[inode] = ("tcp", port)
    if unix:
        req = struct.pack("=BBHIIIII", AF_UNIX, 0, 0, 1 << LISTEN_STATE, 0, UDIAG_SHOW_NAME, 0xFFFFFFFF,
                          0xFFFFFFFF)
        for msg in _dump(sock, AF_UNIX, req, nl.next_seq()):
            if len(msg) < 16:
                continue
            inode = struct.unpack_from("=I", msg, 4)[0]
            off, name = 16, ""
            while off + 4 <= len(msg):
                rlen, rtype = struct.unpack_from("=HH", msg, off)
                if rlen < 4:
                    break
                if rtype == 0:  # UNIX_DIAG_NAME
                    raw = msg[off + 4:off + rlen]
                    name = "@" + raw[1:].decode("utf-8", "replace") if raw[:1] == b"\0" else \
                        raw.rstrip(b"\0").decode("utf-8", "replace")
                off += (rlen + 3) & ~3
            if inode and name and not name.startswith("@") and "/pymp-" not in name:
                out[inode] = ("unix", name)
    return out


SOCKSTAT = ("/proc/self/net/sockstat", "/proc/self/net/sockstat6")
SETTLE_S = 0.5  # after a change, look every time for this long (a socket made, then listening)
FULL_POLL_S = 1.0  # and look at least this often whatever the counters say


class Gate:
    """Whether a look at the listening sockets can find anything new: the network
    namespace's socket counters (``/proc/self/net/sockstat{,6}``: sockets in use, TCP and
    TCPv6 sockets hashed) moved since the last look. A TCP socket that starts to listen is
    hashed then, so it moves them exactly; a unix socket moves them when it is made, not when
    it listens: after any move the watch looks every time for SETTLE_S, and it looks at least
    every FULL_POLL_S (a move masked by another socket closing meanwhile, or a socket that
    listens long after it was made). Two ``pread`` calls instead of a dump's nine system
    calls: each one on the sampler thread costs the busy main thread a switch to hand the
    GIL back. The files are kept open (re-opened in a forked child)."""

    def __init__(self) -> None:
        self.fds: List[int] = []
        self.inos: List[int] = []  # theirs: a number the host reused after closing ours is not closed
        self.pid = 0
        self.key = b""
        self.changed_at = 0.0
        self.looked_at = 0.0
        self.skipped = 0  # looks saved (tests)

    def _read(self) -> bytes:
        pid = os.getpid()
        if self.pid != pid:
            self.close()  # a forked child: its own descriptors (closing ours leaves the parent's)
            self.pid = pid
            for path in SOCKSTAT:
                try:
                    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                except OSError:
                    continue
                try:
                    self.inos.append(os.fstat(fd).st_ino)
                except OSError:
                    os.close(fd)
                    continue
                self.fds.append(fd)
            if len(_gates) < 64:
                _gates.append(self)
        if not self.fds:
            return b""
        try:
            return b"".join(_counts(os.pread(fd, 512, 0)) for fd in self.fds)
        except OSError:
            self.pid = 0  # re-opened at the next look
            return b""

    def changed(self) -> bool:
        """Whether to look now (and note the counters for the next call)."""
        key = self._read()
        now = time.monotonic()
        if not key or key != self.key:
            self.key = key
            self.changed_at = now
        elif now - self.changed_at >= SETTLE_S and now - self.looked_at < FULL_POLL_S:
            self.skipped += 1
            return False
        self.looked_at = now
        return True

    def close(self) -> None:
        fds, inos, self.fds, self.inos, self.pid = self.fds, self.inos, [], [], 0
        for i, fd in enumerate(fds):  # (zip(strict=) is 3.10's)
            if _same(fd, inos[i]):
                try:
                    os.close(fd)
                except OSError:
                    pass


_gates: List[Gate] = []  # those holding descriptors (closed with the netlink socket)


def _counts(text: bytes) -> bytes:
    """The counters that move when a socket is made or starts to listen: ``sockets: used``,
    ``TCP: inuse``, ``TCP6: inuse`` (not memory, time-wait or orphans)."""
    out = []
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 3 and f[0] in (b"sockets:", b"TCP:", b"TCP6:"):
            out.append(f[0] + f[2])
    return b" ".join(out) + b";"


def socket_inodes(pid: Union[int, str], proc_root: str = "/proc") -> Set[int]:
    """Inodes of the sockets ``pid`` holds (``/proc/<pid>/fd/N -> socket:[inode]``)."""
    d = "%s/%s/fd" % (proc_root, pid)
    out: Set[int] = set()
    try:
        names = os.listdir(d)
    except OSError:
        return out
    for n in names:
        try:
            target = os.readlink(d + "/" + n)
        except OSError:
            continue
        if target.startswith("socket:["):
            try:
                out.add(int(target[8:-1]))
            except ValueError:
                continue
    return out


def children(pid: int, proc_root: str = "/proc") -> List[int]:
    """``pid``'s child processes, from ``/proc/<pid>/task/<tid>/children``."""
    out: List[int] = []
    try:
        tids = os.listdir("%s/%d/task" % (proc_root, pid))
    except OSError:
        return out
    for tid in tids:
        out.extend(int(w) for w in _read("%s/%d/task/%s/children" % (proc_root, pid, tid)).split() if w.isdigit())
    return out


def tree(pid: int, proc_root: str = "/proc", limit: int = 256) -> List[int]:
    """``pid`` and its descendants (at most ``limit``)."""
    out: List[int] = []
    todo = [pid]
    while todo and len(out) < limit:
        p = todo.pop()
        out.append(p)
        todo.extend(children(p, proc_root))
    return out


def own_tcp_ports(side: Iterable[int] = ()) -> List[int]:
    """The TCP ports this process holds a listening socket on (its own tables: sock_diag, else
    ``/proc/self/net/tcp{,6}``), ``MASTER_PORT`` and its ``side`` sockets' (inodes) aside; sorted.
    Read once, at readiness."""
    skip = _skip_ports()
    try:
        found = netlink_listening(False, skip)
    except Exception:
        found = tcp_listening(_read("/proc/self/net/tcp"), skip)
        found.update(tcp_listening(_read("/proc/self/net/tcp6"), skip))
    if not found:
        return []  # nothing listens: its descriptors need no look
    mine = socket_inodes("self").difference(side)
    return sorted({port for inode, (kind, port) in found.items()
                   if kind == "tcp" and isinstance(port, int) and inode in mine})


def _skip_ports() -> Tuple[int, ...]:
    port = os.environ.get("MASTER_PORT", "")
    return (int(port),) if port.isdigit() else ()


class ListenWatch:
    """Polls for the first listening socket that the processes ``pids()`` return own."""

    def __init__(self, pids: Callable[[], List[Union[int, str]]], proc_root: str = "/proc",
                 unix: bool = True, netlink: bool = True, inherited: Iterable[int] = (),
                 side: Optional[Set[int]] = None) -> None:
        self.pids = pids
        self.proc_root = proc_root
        self.unix = unix
        self.netlink = netlink and proc_root == "/proc"  # this namespace's tables (see the module doc)
        self.foreign: Set[int] = set()  # listening inodes of other processes (and absorbed ones)
        # Sockets the process shares: held when it started (socket activation, a re-exec, a
        # supervisor's bound socket), or held by its parent too. Listening, they say nothing of
        # readiness (another holder may have listened) until the process claims them.
        self.shared: Set[int] = set(inherited)
        self.claimed: Set[int] = set()  # inodes this process said it serves on (``claim``)
        # Side servers' sockets (a metrics exporter's): never readiness. The caller's set, kept: a socket is added
        # to it before it listens, so no poll can see it listen first.
        self.side: Set[int] = side if side is not None else set()
        self.force = False  # the next poll reads the tables whatever the gate says (a claim)
        self.skip = _skip_ports()
        self._netns: Dict[Union[int, str], bool] = {}  # pid -> in our network namespace
        self.gate = Gate()  # a hooked process's own watch: look only when the counters moved

    def _same_netns(self, pid: Union[int, str]) -> bool:
        """``pid`` is in this process's network namespace (the only one sock_diag answers for)."""
        if pid == "self":
            return True
        seen = self._netns.get(pid)
        if seen is None:
            try:
                seen = os.readlink("/proc/%s/ns/net" % pid) == os.readlink("/proc/self/ns/net")
            except OSError:
                seen = False  # cannot tell: its own /proc tables
            if len(self._netns) < 64:
                self._netns[pid] = seen
        return seen

    def tables(self, pid: Union[int, str]) -> Dict[int, Found]:
        if self.netlink and self._same_netns(pid):
            try:
                return netlink_listening(self.unix, self.skip)
            except OSError:
                self.netlink = False  # refused here: the /proc files from now on
        base = "%s/%s/net/" % (self.proc_root, pid)
        found = tcp_listening(_read(base + "tcp"), self.skip)
        found.update(tcp_listening(_read(base + "tcp6"), self.skip))
        if self.unix:
            found.update(unix_listening(_read(base + "unix")))
        return found

    def _new_owned(self, pids: Optional[List[Union[int, str]]] = None) -> Tuple[Dict[int, Found], List[int]]:
        """The listening table, and the inodes in it not seen before that the processes own
        (the others are remembered as foreign)."""
        if pids is None:
            pids = self.pids()
        if not pids:
            return {}, []
        found = self.tables(pids[0])
        new = [i for i in found if i not in self.foreign and i not in self.shared and i not in self.side]
        if not new:
            return found, []
        owned: Set[int] = set()
        for pid in pids:
            owned |= socket_inodes(pid, self.proc_root)
        self.foreign.update(i for i in new if i not in owned)
        mine = [i for i in new if i in owned]
        if mine and pids == ["self"]:
            # A copy of the parent's socket (a fork after it bound one): whichever of its
            # holders listened, the kernel shows it listening here too. One read of the
            # parent's descriptors, only when a listening socket of ours appears.
            ppid = os.getppid()
            theirs = socket_inodes(ppid, self.proc_root) if ppid > 0 else set()
            self.shared.update(i for i in mine if i in theirs)
            mine = [i for i in mine if i not in theirs]
        return found, mine

    def claim(self, inodes: Iterable[int]) -> None:
        """This process serves on these sockets now (its server's start-up returned): shared
        ones count from the next poll, which reads the tables whatever the gate says."""
        self.claimed.update(inodes)
        self.force = True

    def poll(self) -> Optional[Found]:
        pids = self.pids()
        force, self.force = self.force, False
        if not force and pids == ["self"] and self.netlink and not self.gate.changed():
            return None  # no socket can have started to listen since the last look
        found, new = self._new_owned(pids)
        mine = [found[i] for i in new]
        mine += [found[i] for i in self.claimed if i in found and i not in new]
        if mine:
            tcp = [m for m in mine if m[0] == "tcp"]
            return min(tcp or mine, key=lambda m: str(m[1]))  # a TCP port first: it names the server
        return None

    def absorb(self) -> int:
        """Take the sockets the processes listen on now as none of readiness (a start-up
        call's own RPC server: Ray's core worker). Returns how many were new. Shared sockets
        (another holder may have listened meanwhile) and claimed ones are never taken."""
        _found, new = self._new_owned()
        new = [i for i in new if i not in self.claimed]
        self.foreign.update(new)
        return len(new)
