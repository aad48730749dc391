"""The hooks' own descriptors, told from the host's by identity, not by number (stdlib only).

A host that daemonizes closes every descriptor it did not open (``os.closerange(3, ...)``),
the hooks' socket and spool file among them, and the numbers go to the next files it opens.
A number alone would then make the hooks write their frames into the host's file, read the
host's data, or close it. So each descriptor's identity (device and inode, from ``fstat``)
is recorded when it is opened and checked before it is used or closed; one that is no longer
ours is forgotten without being closed (its number is the host's now) and counted.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # the typing module costs ~10 ms at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Optional, Tuple

    Ident = Tuple[int, int]  # (st_dev, st_ino)

lost = 0  # descriptors of the hooks found closed or reused by the host (every module's, this process)


def ident(fd: int) -> Ident:
    """``fd``'s identity (raises OSError)."""
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino)


def same(fd: Optional[int], want: Optional[Ident]) -> bool:
    """``fd`` is still the descriptor whose identity was ``want`` (one ``fstat``)."""
    if fd is None or fd < 0 or want is None:
        return False
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == want


def close_own(fd: Optional[int], want: Optional[Ident]) -> bool:
    """Close ``fd`` only if it is still ours; True when closed. Otherwise it is counted as
    lost and left alone."""
    global lost
    if fd is None or fd < 0:
        return False
    if not same(fd, want):
        lost += 1
        return False
    try:
        os.close(fd)
    except OSError:
        pass
    return True


def close_sock(sock: Any, want: Optional[Ident]) -> bool:
    """Close the socket object ``sock`` only if its descriptor is still ours; otherwise detach
    it (the object forgets the number, which is not closed) and count it. Never raises."""
    global lost
    if sock is None:
        return False
    try:
        fd = sock.fileno()
    except (OSError, ValueError):
        return False
    if fd < 0:
        return False
    if same(fd, want):
        try:
            sock.close()
        except OSError:
            pass
        return True
    lost += 1
    try:
        sock.detach()
    except OSError:
        pass
    return False


def sock_ident(sock: Any) -> Optional[Ident]:
    """The socket object's identity, or None when it has no descriptor to tell."""
    try:
        return ident(sock.fileno())
    except (OSError, ValueError):
        return None
