"""A Python interpreter for a model's tool calls, in a process that can neither reach out
nor run away.

Every call runs in a fresh interpreter (``python -I``, this one's executable) started in a
new session, with a private temporary folder as its working directory and home, and an
environment of its own (PATH, HOME, TMPDIR, LANG and one thread for numpy's math
libraries, nothing else: no Ray token path, no credentials); its output goes to a file without a name, which the code cannot reach.

Where this process is root and the kernel grants namespaces (``CAP_SYS_ADMIN``), the call
gets the kernel's layers, which hold against code written to defeat everything else:

- a network namespace of its own (no interface up);
- a mount namespace: every mount read-only but its folder, itself a small tmpfs (bounded,
  and gone with the call); a folder above the interpreter that others cannot enter (pyenv's
  ``/root``) is replaced by a tmpfs holding only the interpreter, so that ...
- ... the code runs as ``nobody``, without capabilities: files only the user can read
  (Ray's token) are closed to it, and it can signal no process of the trainer's;
- a process namespace whose first process is the call: when it ends (or is killed at the
  wall-clock bound), everything it started ends too.

Elsewhere (not root, or no namespaces) only a network namespace is tried (through an
unprivileged user namespace). Everywhere, the interpreter then takes resource limits (CPU
seconds, address space, the largest file, processes, no core dumps) and installs an audit
hook (:pep:`578`) that refuses sockets, new processes (fork, exec, spawn, subprocess),
signals, calling native code through ctypes (importing it stays possible: numpy and sympy
do), links, ``gc``'s object walks, and opening, listing or changing a file outside its
folder, except reading the interpreter's own. The hook gives a model clear refusals; it is
not a security boundary (its state can be reached from a refusal's traceback: CPython says
as much of audit hooks), so where the kernel's layers are missing, a determined escape is
possible. Each :class:`SandboxRun` says which layers its call had.

The parent waits at most the wall-clock bound, then ends the call and its session. A call
that overruns a bound comes back as output saying so (``timed_out``, ``cut``).
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
from typing import Optional

NOBODY = "nobody"
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
"""numpy's math libraries on one thread: a block's threads count against its user's
``RLIMIT_NPROC``, shared by every block running at once."""
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
    folder_bytes: int = 64 << 20
    """The private folder's size, where the call has mounts of its own (a tmpfs);
    elsewhere only each file is bounded (``file_bytes``)."""
    output_chars: int = 2000
    """What of the output comes back (a longer one's start and end, reported as cut)."""
    processes: int = 64
    """``RLIMIT_NPROC`` of the user it runs as (not enforced for root; fork is refused by
    the audit hook in any case)."""

    def __post_init__(self) -> None:
        for name in (
            "wall_seconds",
            "cpu_seconds",
            "memory_bytes",
            "file_bytes",
            "folder_bytes",
            "output_chars",
            "processes",
        ):
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
    """It had all of the kernel's layers: ``nobody``, read-only mounts but its folder, its
    own process namespace (see the module docstring)."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


# The child's first code: isolation, limits, the audit hook, then the model's code (the
# last expression's value printed, as a notebook does). Everything is local to one
# function, so nothing of it is a global the model's code could reach. argv: folder, CPU
# seconds, memory bytes, file bytes, folder bytes, processes, uid and gid to become (-1:
# stay), the descriptor to report the layers on.
_BOOTSTRAP = r"""
def sandbox():
    import os, resource, signal, sys, types, _thread
    folder, cpu, memory, file_bytes, folder_bytes, processes, uid, gid, report = sys.argv[1], *map(int, sys.argv[2:10])
    with open(os.path.join(folder, "code.py"), encoding="utf-8") as handle:
        source = handle.read()
    folder = os.path.realpath(folder)
    roots = sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)})
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    def call(name, *args):
        if getattr(libc, name)(*args) != 0:
            number = ctypes.get_errno()
            raise OSError(number, f"{name}{args}: {os.strerror(number)}")
    def mount(source, target, kind, flags, data):
        call("mount", source and source.encode(), target.encode(), kind and kind.encode(), flags, data and data.encode())
    # As root: mounts, processes and network of its own (where the kernel grants them).
    isolated = os.geteuid() == 0 and uid >= 0 and libc.unshare(0x00020000 | 0x20000000 | 0x40000000) == 0
    if isolated:
        try:  # everything read-only but its folder, the interpreter reachable for the other user
            mount(None, "/", None, 16384 | (1 << 18), None)
            closed = {}
            for root in roots:
                parts = root.strip("/").split("/")
                for depth in range(1, len(parts)):
                    above = "/" + "/".join(parts[:depth])
                    if not os.stat(above).st_mode & 0o001:
                        closed.setdefault(above, []).append(root)
                        break
            for above, inside in closed.items():
                stashes = []
                for number, root in enumerate(inside):
                    stash = os.path.join(folder, f".root{number}")
                    os.mkdir(stash)
                    mount(root, stash, None, 4096 | 16384, None)
                    stashes.append(stash)
                mount("tmpfs", above, "tmpfs", 0, "mode=0755,size=1m")
                for root, stash in zip(inside, stashes):
                    os.makedirs(root, exist_ok=True)
                    mount(stash, root, None, 4096 | 16384, None)
                    call("umount2", stash.encode(), 2)
            mount("tmpfs", folder, "tmpfs", 0, f"size={folder_bytes},mode=0700,uid={uid},gid={gid}")
            with open("/proc/self/mountinfo") as handle:  # everything else read-only
                points = [line.split()[4] for line in handle]
            for point in points:
                point = point.encode().decode("unicode_escape")
                if point != folder:
                    try:
                        mount(None, point, None, 32 | 4096 | 1, None)
                    except OSError:
                        pass  # a mount that cannot be remounted (locked): left as it is
        except OSError as exc:
            sys.exit(f"sandbox: could not isolate the call ({exc})")
        child = os.fork()  # process 1 of the new namespace: when it ends, everything it started ends
        if child:
            os.write(report, b"11")
            os.close(report)
            # Stopped at the wall-clock bound: end the namespace, and still reap its first process.
            signal.signal(signal.SIGTERM, lambda *_: os.kill(child, signal.SIGKILL))
            status = os.waitpid(child, 0)[1]
            code = os.waitstatus_to_exitcode(status)
            if code < 0:  # ended by a signal: end by it too
                if -code not in (signal.SIGKILL, signal.SIGSTOP):
                    signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            os._exit(code)
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        call("prctl", 1, 9)  # killed with its parent
    else:
        network = libc.unshare(0x40000000 if os.geteuid() == 0 else 0x10000000 | 0x40000000) == 0
        os.write(report, f"{int(network)}0".encode())
    os.close(report)
    del libc, ctypes, call, mount
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]
    os.chdir(folder)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    readable = tuple(r for r in roots if r != "/") + ("/usr/share/zoneinfo",)
    devices = ("/dev/null", "/dev/urandom", "/dev/random")
    refused = frozenset((
        "socket.__new__", "socket.bind", "socket.connect", "socket.getaddrinfo", "socket.gethostbyname",
        "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system", "subprocess.Popen",
        "os.kill", "os.killpg", "signal.pthread_kill", "os.symlink", "os.link", "ctypes.dlsym", "ctypes.cdata",
        "ctypes.call_function", "sys.setprofile", "sys.settrace", "os.chroot", "os.setuid", "gc.get_objects",
        "gc.get_referrers", "gc.get_referents", "resource.prlimit", "resource.setrlimit", "fcntl.ioctl",
        "sqlite3.connect",
    ))
    modules = frozenset(("_posixsubprocess", "multiprocessing", "_multiprocessing"))
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    busy = set()
    ident = _thread.get_ident
    def under(path, places):
        if isinstance(path, int):
            return True
        text = os.fsdecode(path)
        if os.pardir in text.split(os.sep):
            return False  # a path relative to a folder descriptor is not checked here
        real = os.path.realpath(text)
        return any(real == place or real.startswith(place + os.sep) for place in places)
    def guard(event, args):
        me = ident()
        if me in busy:
            return
        busy.add(me)
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
                           "shutil.rmtree", "shutil.copyfile", "shutil.move", "os.chdir"):
                if not under(args[0], (folder,)):
                    raise PermissionError(f"sandbox: {event} outside the working folder is not allowed")
            elif event == "os.rename":
                if not (under(args[0], (folder,)) and under(args[1], (folder,))):
                    raise PermissionError("sandbox: os.rename outside the working folder is not allowed")
            elif event in ("os.listdir", "os.scandir"):
                if args[0] is not None and not (under(args[0], (folder,)) or under(args[0], readable)):
                    raise PermissionError(f"sandbox: listing {args[0]!r} is not allowed")
        finally:
            busy.discard(me)
    # subprocess's native fork raises no audit event: loaded now (so importing subprocess,
    # as sympy does, works) and replaced; importing it afresh is refused by the hook.
    import subprocess, _posixsubprocess
    def refuse_fork_exec(*args, **kwargs):
        raise PermissionError("sandbox: starting a process is not allowed")
    subprocess._fork_exec = _posixsubprocess.fork_exec = refuse_fork_exec
    sys.addaudithook(guard)
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    return source, main.__dict__
source, namespace = sandbox()
del sandbox
def run(source, namespace):
    import ast, sys, traceback
    globals().clear()  # the bootstrap's module is not the model's: nothing of it stays
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
run(source, namespace)
"""


def _user() -> tuple[int, int]:
    """The uid and gid a call runs as where it is isolated: ``nobody`` when this process
    is root (and the user exists), else (-1, -1) for this process's own."""
    if os.geteuid() != 0:
        return -1, -1
    try:
        entry = pwd.getpwnam(NOBODY)
    except KeyError:
        return -1, -1
    return entry.pw_uid, entry.pw_gid


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxRun:
    """Run ``code`` in a sandboxed interpreter (see the module docstring); never raises
    for what the code does."""
    started = time.monotonic()
    folder = tempfile.mkdtemp(prefix="dapo-sandbox-")
    uid, gid = _user()
    report_read, report_write = os.pipe()
    try:
        with open(os.path.join(folder, "code.py"), "w", encoding="utf-8") as handle:
            handle.write(code)
        if uid >= 0:
            os.chown(folder, uid, gid)
        # The output goes to a file without a name: the code cannot replace or reopen it.
        with tempfile.TemporaryFile() as output:
            arguments = (
                folder,
                limits.cpu_seconds,
                limits.memory_bytes,
                limits.file_bytes,
                limits.folder_bytes,
                limits.processes,
                uid,
                gid,
                report_write,
            )
            process = subprocess.Popen(
                [sys.executable, "-I", "-c", _BOOTSTRAP, *map(str, arguments)],
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                cwd=folder,
                env={"PATH": "/usr/bin:/bin", "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8", **ONE_THREAD},
                start_new_session=True,
                close_fds=True,
                pass_fds=(report_write,),
            )
            os.close(report_write)
            report_write = -1
            timed_out = False
            try:
                exit_code: Optional[int] = process.wait(timeout=limits.wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out, exit_code = True, None
                process.terminate()  # an isolated call's first process then kills its namespace, and reaps
                try:
                    process.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    pass
            _kill_session(process.pid)
            process.wait()
            timed_out = timed_out or exit_code in (-signal.SIGXCPU, -signal.SIGKILL)
            text, written = _read_output(output, limits.output_chars)
        cut = written > len(text.encode("utf-8", errors="replace")) or written >= limits.file_bytes
        layers = os.read(report_read, 2).decode()
        seconds = time.monotonic() - started
        return SandboxRun(text, exit_code, timed_out, cut, seconds, layers[:1] == "1", layers[1:2] == "1")
    finally:
        os.close(report_read)
        if report_write >= 0:
            os.close(report_write)
        _remove(folder)


def _remove(folder: str) -> None:
    """Remove the call's folder, whatever the code left in it."""
    try:
        shutil.rmtree(folder, ignore_errors=True)
    except Exception:  # noqa: BLE001 - a folder nested past the recursion limit, say
        pass


def _read_output(output, chars: int) -> tuple[str, int]:
    """The output's text as it comes back, and how many bytes were written: all of it
    when it fits in ``chars``, else its start and its end (where a traceback ends) with
    a marker between them."""
    written = os.fstat(output.fileno()).st_size
    output.seek(0)
    head = output.read(4 * chars + 4).decode("utf-8", errors="replace")
    if written <= 4 * chars + 4 and len(head) <= chars:
        return head, written
    output.seek(max(written - 2 * chars, 0))
    tail = output.read(2 * chars).decode("utf-8", errors="replace")
    half = (chars - len(CUT_MARK)) // 2
    return head[:half] + CUT_MARK + tail[len(tail) - half :], written


def _kill_session(pid: int) -> None:
    """Kill every process of the call's session (its group: the sandbox started one)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
