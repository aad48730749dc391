"""CMD's stderr under ``launch``: copied through unchanged, memory errors handed to the agent.

Native engines (llama.cpp's server, ollama, TensorRT-LLM's C++ runtime, ONNX Runtime's
logger) print their memory errors on file descriptor 2, where no Python hook sees them.
``launch`` gives CMD a pipe for its stderr (a pseudo-terminal when launch's own stderr is a
terminal, so CMD still sees a terminal: colours, progress bars and its window size stay)
and this relay's thread copies every byte to launch's stderr as it arrives. Lines are
checked with the same fixed-string prefilter as the hooks (``NEEDLES``); a line that holds
one opens a capture (with the lines before it, for context) that ends a few lines after the
last such line, on a pause, or at EOF, and the captured text goes to ``on_text`` for the
agent's serving rules to classify.

Stdlib only (launch's cheap half imports it before CMD starts). Never loses output: a
failed write to launch's stderr drops only the copy, the relay keeps reading so CMD never
blocks on a full pipe.
"""

from __future__ import annotations

import collections
import errno
import os
import select
import threading
import time
from collections.abc import Callable

NEEDLES = (  # = rules.serving.NEEDLES
    "memory", "alloc", "kv cache", "kvcache", "cache blocks", "resource_exhausted", "resource exhausted",
    "are available (after", "mem_buffer", "kv slot", "failed to create context",
    "swap space", "no space left for only one request", "not enough vram", "insufficient workspace",
    "failed to decode the batch", "cache entries", "cudnn convolution algorithm", "no enough blocks",
    "buffer maximum", "capacity of block_manager", "context size has been exceeded",
)
# Lines that hold a needle but report no failure: PyTorch >= 2.13's caching allocator logs this warning on every
# failed cudaMalloc attempt, the ones it recovers from by freeing its cache and retrying included
# (pytorch#193195); vLLM, which fills the device by design, prints it thousands of times while it starts. With
# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True the same retry logs "expandable_segments: memory mapping failed
# with OOM on device N while trying to map ..." (CUDACachingAllocator.cpp, mapping a 20 MiB page). An attempt that
# stays failed raises torch.OutOfMemoryError, whose own line opens a capture.
NOT_FAILURES = ("memory allocation failed with OOM on device", "memory mapping failed with OOM on device")
CONTEXT_LINES = 40  # lines kept before a needle line (what serving rules read as context)
# Lines kept after the last needle line: every line a serving rule may read from its anchor line on (its window,
# at most 40 lines with the anchor's), so a stderr copy carries the numbers the exception or log copy does (Ray's
# memory monitor prints the killed task's size 28 lines after its first line) and the two are one OOM.
AFTER_LINES = 39
PAUSE_S = 0.05  # a capture also ends when CMD pauses this long (DESIGN: OOM to result < 100 ms)
MAX_LINE = 16384  # a longer line keeps its head and its tail (an error ends a JSON record or a traceback line)
ELLIPSIS = b" [...] "
# A capture never grows past what the agent reads of a text: before a line would take it past MAX_CAPTURE_CHARS,
# its lines up to WINDOW_BACK lines before its latest needle line are handed over (more when the rest still would
# not leave room), and the rest start the next capture: a multi-line error stays in one piece, and no line is
# let go unsent (but past the rate below).
MAX_CAPTURE_CHARS = 16384
WINDOW_BACK = 16
# At most this many full captures are handed over per second (the agent spends ~10 ms of its loop on each): past
# that, the part that would have gone rolls instead: its lines that report a failure are kept (up to
# PINNED_CHARS, the latest), the rest go, counted in ``rolled_lines``, until the stream pauses or ends.
MAX_FULL_PER_S = 4
PINNED_CHARS = 4096
FAILURE_WORDS = ("error", "failed", "failure", "fatal", "exception", "out of memory", "abort")
MAX_PENDING_CAPTURES = 64  # captures waiting for the agent side (launch imports it while CMD starts)


class StderrRelay:
    """One pipe (or pty) between CMD's fd 2 and launch's own stderr."""

    def __init__(self, out_fd: int = 2) -> None:
        self.out_fd = out_fd
        self.tty = _isatty(out_fd)
        if self.tty:
            self.read_fd, self.child_fd = os.openpty()
            _copy_terminal(out_fd, self.child_fd)
        else:
            self.read_fd, self.child_fd = os.pipe()
        os.set_inheritable(self.read_fd, False)
        self.on_text: Callable[[str], None] | None = None
        self.on_open: Callable[[], None] | None = None  # a capture opened (its text comes later)
        self.pending: collections.deque[str] = collections.deque(maxlen=MAX_PENDING_CAPTURES)
        self.captures = 0
        self.copy_errors = 0
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._before: collections.deque[str] = collections.deque(maxlen=CONTEXT_LINES)
        self._capture: list[str] | None = None
        self._capture_chars = 0
        self._last_hit = -1  # the open capture's latest needle line (its index)
        self._full_times: collections.deque[float] = collections.deque(maxlen=MAX_FULL_PER_S)
        self.rolled_lines = 0  # lines a rolling capture let go (a needle stream faster than the agent reads)
        self._after = 0
        self._partial = b""
        self.wakeups = 0  # the thread's returns from select (tests)

    # -- launch side ------------------------------------------------------------------------

    def started(self) -> None:
        """CMD holds its end now: close ours, start copying."""
        os.close(self.child_fd)
        self.child_fd = -1
        self._thread = threading.Thread(target=self._run, name="infersight-stderr", daemon=True)
        self._thread.start()

    def resize(self) -> None:
        """Launch's terminal changed size (SIGWINCH): CMD's stderr terminal follows."""
        if self.tty and self.child_fd < 0:
            _copy_winsize(self.out_fd, self.read_fd)

    @property
    def memory_error_seen(self) -> bool:
        """A capture opened (CMD's stderr showed a memory error), whether or not it ended."""
        return self.captures > 0 or self._capture is not None

    def set_consumer(self, fn: Callable[[str], None], on_open: Callable[[], None] | None = None) -> None:
        """Hand captures to ``fn`` (from the relay's thread), the waiting ones first; call
        ``on_open`` (quick) when a capture opens, at least ``PAUSE_S`` before its text comes."""
        with self._lock:
            self.on_text = fn
            self.on_open = on_open
            waiting = list(self.pending)
            self.pending.clear()
        for text in waiting:
            fn(text)

    def wait_closed(self, timeout_s: float) -> bool:
        """Wait until every writer closed CMD's stderr (a daemonised grandchild may keep it)."""
        return self._done.wait(timeout_s)

    # -- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                # A pause ends only an open capture: with none, wait for CMD's next bytes (a
                # timeout woke this thread 20 times a second for CMD's whole life, each wake-up
                # taking a core, CMD's on a busy host).
                ready, _, _ = select.select([self.read_fd], [], [], PAUSE_S if self._capture is not None else None)
                self.wakeups += 1
                if not ready:
                    self._flush_capture()
                    continue
                try:
                    data = os.read(self.read_fd, 65536)
                except OSError as exc:  # a pty's master reads EIO once every slave is closed
                    if exc.errno in (errno.EIO, errno.EBADF):
                        break
                    raise
                if not data:
                    break
                self._copy(data)
                self._scan(data)
        finally:
            if self._partial:
                self._line(self._partial)
                self._partial = b""
            self._flush_capture()
            try:
                os.close(self.read_fd)
            except OSError:
                pass
            self._done.set()

    def _copy(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.out_fd, view)
            except InterruptedError:
                continue
            except OSError:
                self.copy_errors += 1  # launch's stderr is gone: keep reading, CMD must not block
                return
            view = view[n:]

    def _scan(self, data: bytes) -> None:
        buf = self._partial + data
        *lines, self._partial = buf.split(b"\n")
        if len(self._partial) > MAX_LINE:
            lines.append(self._partial)
            self._partial = b""
        if self._capture is None and not _holds_needle(buf):
            # The common chunk: no capture open and no needle in it (a few scans in C for the whole chunk, not a
            # decode and a lower-casing per line): its last lines are kept as the next capture's context only.
            for raw in lines[-CONTEXT_LINES:]:
                self._before.append(_decoded(raw))
            return
        for raw in lines:
            self._line(raw)

    def _line(self, raw: bytes) -> None:
        line = _decoded(raw)
        low = line.lower()
        hit = any(n in low for n in NEEDLES) and not any(q in line for q in NOT_FAILURES)
        if self._capture is not None:
            self._make_room(len(line) + 1)
        if self._capture is None:
            if hit:
                self._capture = [*self._context(MAX_CAPTURE_CHARS // 2 - len(line)), line]
                self._capture_chars = sum(len(x) + 1 for x in self._capture)
                self._last_hit = len(self._capture) - 1
                self._after = AFTER_LINES
                self._opened()
            self._before.append(line)
            return
        self._capture.append(line)
        self._capture_chars += len(line) + 1
        if hit:
            self._last_hit = len(self._capture) - 1
        self._before.append(line)
        if hit:
            self._after = AFTER_LINES
        else:
            self._after -= 1
            if self._after <= 0:
                self._flush_capture()

    def _make_room(self, n: int) -> None:
        """Before a line of ``n`` characters joins the open capture: when it would take the capture past
        MAX_CAPTURE_CHARS, hand over its lines up to WINDOW_BACK before the latest needle line, or as many
        more as leave room (all of them, for a line that needs the whole of it)."""
        cap = self._capture
        assert cap is not None
        if self._capture_chars + n <= MAX_CAPTURE_CHARS:
            return
        split, chars = 0, self._capture_chars
        while split < len(cap) and chars + n > MAX_CAPTURE_CHARS:  # the fewest first lines that leave room
            chars -= len(cap[split]) + 1
            split += 1
        self._hand_over(max(split, min(self._last_hit - WINDOW_BACK, len(cap))), n)

    def _hand_over(self, split: int, n: int) -> None:
        """Send the open capture's lines before ``split`` (over MAX_FULL_PER_S a second, roll them instead,
        keeping those that report a failure while they leave room for a line of ``n``); the rest stay open."""
        cap = self._capture
        assert cap is not None
        head, tail = cap[:split], cap[split:]
        now = time.monotonic()
        kept: list[str] = []
        if len(self._full_times) < MAX_FULL_PER_S or now - self._full_times[0] > 1.0:
            if head:
                self._full_times.append(now)
                self._send("\n".join(head))
        else:
            room = min(PINNED_CHARS, MAX_CAPTURE_CHARS - n - sum(len(x) + 1 for x in tail))
            for x in reversed(head):
                if len(x) + 1 <= room and any(w in x.lower() for w in FAILURE_WORDS):
                    kept.append(x)
                    room -= len(x) + 1
            kept.reverse()
            self.rolled_lines += len(head) - len(kept)
        self._capture = kept + tail
        self._capture_chars = sum(len(x) + 1 for x in self._capture)
        self._last_hit = max(self._last_hit - split + len(kept), -1)

    def _context(self, budget: int) -> list[str]:
        """The latest lines before this one, as many as fit in ``budget`` characters."""
        out: list[str] = []
        for line in reversed(self._before):
            budget -= len(line) + 1
            if budget < 0:
                break
            out.append(line)
        out.reverse()
        return out

    def _opened(self) -> None:
        fn = self.on_open
        if fn is not None:
            try:
                fn()
            except Exception:
                pass

    def _flush_capture(self) -> None:
        if self._capture is None:
            return
        text = "\n".join(self._capture)
        self._capture = None
        if text:
            self._send(text)

    def _send(self, text: str) -> None:
        self.captures += 1
        with self._lock:
            fn = self.on_text
            if fn is None:
                self.pending.append(text)
                return
        try:
            fn(text)
        except Exception:
            pass


_NEEDLE_BYTES = tuple(n.encode("ascii") for n in NEEDLES)


def _holds_needle(chunk: bytes) -> bool:
    """Whether a needle may be in ``chunk`` (ASCII case folded, as the needles are ASCII)."""
    low = chunk.lower()
    return any(n in low for n in _NEEDLE_BYTES)


def _decoded(raw: bytes) -> str:
    """One line of CMD's stderr as text: a line over MAX_LINE keeps its head and its tail."""
    if len(raw) > MAX_LINE:
        half = (MAX_LINE - len(ELLIPSIS)) // 2
        raw = raw[:half] + ELLIPSIS + raw[-half:]
    return raw.decode("utf-8", "replace").rstrip("\r")


def open_relay(out_fd: int = 2) -> StderrRelay | None:
    """A relay for CMD's stderr, or None when launch's stderr is closed or no pipe can be made."""
    try:
        os.fstat(out_fd)
        return StderrRelay(out_fd)
    except OSError:
        return None


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def _copy_terminal(src: int, dst: int) -> None:
    """The pty CMD writes to behaves like launch's terminal, without output processing twice."""
    try:
        import termios

        attrs = termios.tcgetattr(src)
        attrs[1] &= ~termios.OPOST  # launch's terminal does the output processing
        termios.tcsetattr(dst, termios.TCSANOW, attrs)
    except (ImportError, OSError):
        pass
    _copy_winsize(src, dst)


def _copy_winsize(src: int, dst: int) -> None:
    try:
        import fcntl
        import termios

        size = fcntl.ioctl(src, termios.TIOCGWINSZ, b"\0" * 8)
        fcntl.ioctl(dst, termios.TIOCSWINSZ, size)
    except (ImportError, OSError):
        pass
