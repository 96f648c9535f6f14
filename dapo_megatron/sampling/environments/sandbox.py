"""A Python interpreter for a model's tool calls, in a process that can neither reach out
nor run away.

Every call runs in a fresh interpreter (``python -I``, this one's executable) started in a
new session, with a private temporary folder as its working directory and home, and an
environment of its own (PATH, HOME, TMPDIR, LANG and nothing else: no Ray token path, no
credentials). Before the model's code runs, the interpreter

- leaves the network: a fresh network namespace (no interface but a loopback that is
  down), where the kernel allows one (as root, or with unprivileged user namespaces);
- as root, becomes ``nobody`` (files only the user can read, such as Ray's token, are
  then closed to it by the kernel);
- takes resource limits: CPU seconds, address space, the largest file it may write (its
  output goes to such a file), processes, no core dumps;
- installs an audit hook (:pep:`578`) that refuses sockets, new processes (fork, exec,
  spawn, subprocess), signals to others, loading or calling native code through ctypes
  (importing it stays possible: numpy and sympy do), links, and opening
  a file outside its folder, except reading the interpreter's own files.

The parent waits at most the wall-clock bound and then kills the whole session. A call
that overruns a bound comes back as output saying so (``timed_out``, ``cut``); nothing
the code does can hang or crash the rollout.

The audit hook is a guard against a model's mistakes and casual escapes, not a security
boundary against code written to defeat it (CPython's own documentation says as much);
the kernel's layers (namespace, user, limits) are what hold against that, and where the
kernel grants neither namespace nor user change, only the hook and the limits stand.
Each :class:`SandboxRun` says which of the kernel's layers its call had.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

NOBODY = "nobody"
CUT_MARK = "\n[...]\n"
"""Where a long output's start and end meet."""


@dataclass(frozen=True)
class SandboxLimits:
    """The bounds of one call."""

    wall_seconds: float = 10.0
    """Wall-clock time from start to exit; the process and anything it started are then
    killed."""
    cpu_seconds: int = 10
    """CPU time (``RLIMIT_CPU``)."""
    memory_bytes: int = 1 << 30
    """Address space (``RLIMIT_AS``): an allocation beyond it raises MemoryError."""
    file_bytes: int = 1 << 20
    """The largest file the code may write, its printed output included (``RLIMIT_FSIZE``):
    printing more stops with 'File too large'."""
    output_chars: int = 2000
    """What of the output comes back (a longer one's start and end, reported as cut)."""
    processes: int = 64
    """``RLIMIT_NPROC`` of the user it runs as (not enforced for root; fork is refused by
    the audit hook in any case)."""

    def __post_init__(self) -> None:
        for name in ("wall_seconds", "cpu_seconds", "memory_bytes", "file_bytes", "output_chars", "processes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox limit {name}={getattr(self, name)!r} must be positive")
        if self.memory_bytes < 64 << 20:
            raise ValueError(f"memory_bytes={self.memory_bytes} is below the 64 MiB an interpreter needs to start")


@dataclass(frozen=True)
class SandboxRun:
    """What one call gave."""

    output: str
    """Its stdout and stderr together (a traceback included), at most ``output_chars``:
    a longer output's start and end, :data:`CUT_MARK` between them."""
    exit_code: Optional[int]
    """The interpreter's exit status; negative: killed by that signal; None: killed at the
    wall-clock bound."""
    timed_out: bool
    """It ran out of its wall-clock or CPU time."""
    cut: bool
    """Its output was longer than came back (or than it was allowed to write)."""
    seconds: float
    """Wall-clock time of the call, start to cleanup."""
    own_network: bool = False
    """It ran in a network namespace of its own (no interface up)."""
    other_user: bool = False
    """It ran as ``nobody`` (this process being root)."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


# The child's first code: limits, isolation, the audit hook, then the model's code (the
# last expression's value printed, as a notebook does). argv: folder, cpu seconds, memory
# bytes, file bytes, processes, uid, gid (-1: keep).
_BOOTSTRAP = r"""
import ast, os, resource, sys, traceback
folder, cpu, memory, file_bytes, processes, uid, gid = sys.argv[1], *map(int, sys.argv[2:8])
network = 0
try:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    network = int(libc.unshare(0x40000000 if os.geteuid() == 0 else 0x10000000 | 0x40000000) == 0)
    del libc, ctypes
except Exception:
    pass
for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
    del sys.modules[name]
if uid >= 0:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
with open(os.path.join(folder, ".isolation"), "w") as handle:
    handle.write(f"{network} {int(uid >= 0)}")
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
with open(os.path.join(folder, "code.py"), encoding="utf-8") as handle:
    source = handle.read()
folder = os.path.realpath(folder)
readable = tuple(sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                        sys.base_exec_prefix, "/usr/share/zoneinfo") if os.path.realpath(p) != "/"}))
devices = ("/dev/null", "/dev/urandom", "/dev/random")
refused = frozenset(("socket.__new__", "socket.bind", "socket.connect", "socket.getaddrinfo",
    "socket.gethostbyname", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system",
    "subprocess.Popen", "os.kill", "os.killpg", "os.symlink", "os.link", "ctypes.dlsym", "ctypes.cdata",
    "ctypes.call_function", "sys.setprofile", "sys.settrace", "os.chroot", "os.setuid", "gc.get_objects",
    "gc.get_referrers", "gc.get_referents"))
modules = frozenset(("_posixsubprocess", "multiprocessing", "_multiprocessing"))
writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
checking = []
def under(path, roots):
    if isinstance(path, int):
        return True
    real = os.path.realpath(os.fsdecode(path))
    return any(real == root or real.startswith(root + os.sep) for root in roots)
def guard(event, args):
    if checking:
        return
    checking.append(1)
    try:
        if event in refused:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "ctypes.dlopen" and args[0] is not None:
            raise PermissionError(f"sandbox: loading the native library {args[0]!r} is not allowed")
        if event == "import" and args[0].partition(".")[0] in modules:
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        if event == "open":
            path, mode, flags = args
            wants_write = bool((flags or 0) & writing) or any(c in (mode or "") for c in "wax+")
            if not under(path, (folder,)) and (wants_write or not (under(path, readable) or path in devices)):
                raise PermissionError(f"sandbox: opening {path!r} is not allowed (only files in the working folder)")
        elif event in ("os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate", "os.utime",
                       "shutil.rmtree", "shutil.copyfile", "shutil.move"):
            if not under(args[0], (folder,)):
                raise PermissionError(f"sandbox: {event} outside the working folder is not allowed")
        elif event == "os.rename":
            if not (under(args[0], (folder,)) and under(args[1], (folder,))):
                raise PermissionError("sandbox: os.rename outside the working folder is not allowed")
        elif event in ("os.listdir", "os.scandir"):
            if args[0] is not None and not (under(args[0], (folder,)) or under(args[0], readable)):
                raise PermissionError(f"sandbox: listing {args[0]!r} is not allowed")
    finally:
        checking.pop()
# subprocess's native fork raises no audit event: loaded now (so importing subprocess, as
# sympy does, works) and replaced; importing it afresh is refused by the hook.
import subprocess, _posixsubprocess
def refuse_fork_exec(*args, **kwargs):
    raise PermissionError("sandbox: starting a process is not allowed")
subprocess._fork_exec = _posixsubprocess.fork_exec = refuse_fork_exec
sys.addaudithook(guard)
del guard
namespace = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    tree = ast.parse(source, "<code>")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<code>", "exec"), namespace)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), "<code>", "eval"), namespace)
        if value is not None:
            print(repr(value))
except SystemExit:
    raise
except BaseException as exc:
    sys.stdout.flush()
    traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
    sys.exit(1)
"""


@lru_cache(maxsize=1)
def _user() -> tuple[int, int]:
    """The uid and gid to run as: ``nobody`` when this process is root, the user exists
    and can read the interpreter's files; else (-1, -1) for this process's own."""
    if os.geteuid() != 0:
        return -1, -1
    try:
        entry = pwd.getpwnam(NOBODY)
    except KeyError:
        return -1, -1
    interpreter = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    if not all(_world_readable(os.path.realpath(folder)) for folder in interpreter):
        return -1, -1
    return entry.pw_uid, entry.pw_gid


def _world_readable(folder: str) -> bool:
    """Whether any user can reach ``folder`` (every folder above it searchable by others)
    and list it."""
    path = folder
    while True:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            return False
        if not mode & 0o001 or (path == folder and not mode & 0o004):
            return False
        if path == os.path.dirname(path):
            return True
        path = os.path.dirname(path)


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxRun:
    """Run ``code`` in a sandboxed interpreter (see the module docstring); never raises
    for what the code does."""
    started = time.monotonic()
    folder = tempfile.mkdtemp(prefix="dapo-sandbox-")
    uid, gid = _user()
    try:
        with open(os.path.join(folder, "code.py"), "w", encoding="utf-8") as handle:
            handle.write(code)
        if uid >= 0:
            os.chown(folder, uid, gid)
        output_path = os.path.join(folder, ".output")
        with open(output_path, "wb") as output:
            arguments = (folder, limits.cpu_seconds, limits.memory_bytes, limits.file_bytes, limits.processes, uid, gid)
            process = subprocess.Popen(
                [sys.executable, "-I", "-c", _BOOTSTRAP, *map(str, arguments)],
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                cwd=folder,
                env={"PATH": "/usr/bin:/bin", "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8"},
                start_new_session=True,
                close_fds=True,
            )
            timed_out = False
            try:
                exit_code: Optional[int] = process.wait(timeout=limits.wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out, exit_code = True, None
            _kill_session(process.pid)
            process.wait()
        timed_out = timed_out or exit_code in (-signal.SIGXCPU, -signal.SIGKILL)
        text, written = _read_output(output_path, limits.output_chars)
        cut = written > len(text.encode("utf-8", errors="replace")) or written >= limits.file_bytes
        try:
            with open(os.path.join(folder, ".isolation")) as handle:
                network, user = (flag == "1" for flag in handle.read().split())
        except (OSError, ValueError):
            network = user = False
        seconds = time.monotonic() - started
        return SandboxRun(text[: limits.output_chars], exit_code, timed_out, cut, seconds, network, user)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _read_output(path: str, chars: int) -> tuple[str, int]:
    """The output's text as it comes back, and how many bytes were written: all of it
    when it fits in ``chars``, else its start and its end (where a traceback ends) with
    a marker between them."""
    with open(path, "rb") as output:
        written = os.fstat(output.fileno()).st_size
        head = output.read(4 * chars + 4).decode("utf-8", errors="replace")
        if written <= 4 * chars + 4 and len(head) <= chars:
            return head, written
        output.seek(max(written - 2 * chars, 0))
        tail = output.read().decode("utf-8", errors="replace")
    half = (chars - len(CUT_MARK)) // 2
    return head[:half] + CUT_MARK + tail[len(tail) - half :], written


def _kill_session(pid: int) -> None:
    """Kill every process of the call's session (its group: the sandbox started one)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
