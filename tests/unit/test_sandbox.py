"""The ``python`` environment's sandbox: code that tries to get out (a socket, Ray's token
file, a fork bomb, 8 GB, 100 MB of output, a file outside its folder, sleeping or spinning
forever) is refused or cut within its bound, and the episode goes on; tool-integrated math
(numpy, sympy) works; an episode answers a stuck tool with an observation, counted."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path

import pytest

from dapo_megatron.orchestration.cluster import write_token
from dapo_megatron.rollout.engine import SamplingParams
from dapo_megatron.sampling.environments import make_environment
from dapo_megatron.sampling.environments.python_tool import called_code
from dapo_megatron.sampling.environments.sandbox import CUT_MARK, SandboxLimits, run_python
from dapo_megatron.sampling.episodes import run_episodes
from tests.unit.test_episodes import EOS, TOKENIZER, _prompt, _Scripted

QUICK = SandboxLimits(wall_seconds=1.5, cpu_seconds=1, memory_bytes=512 << 20, file_bytes=1 << 20, output_chars=400)


def test_a_block_prints_and_shows_its_last_expression_with_numpy_and_sympy():
    run = run_python(
        "import numpy as np\nimport sympy\nx = sympy.symbols('x')\nprint(np.arange(5).sum())\n"
        "sorted(sympy.solve(x**2 - 4, x))"
    )
    assert run.ok and run.output == "10\n[-2, 2]\n", run.output
    run = run_python("import math\nmath.factorial(20)\nNone")
    assert run.ok and run.output == ""  # a last expression of None prints nothing
    run = run_python("1/0", QUICK)
    assert run.exit_code == 1 and run.output.endswith("ZeroDivisionError: division by zero\n")
    assert 'File "<code>", line 1' in run.output


def test_a_socket_reaches_nothing():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        by_name = run_python(f"import socket\nsocket.create_connection(('localhost', {port}), timeout=1)", QUICK)
        by_address = run_python(f"import socket\nsocket.socket().connect(('127.0.0.1', {port}))", QUICK)
        server.settimeout(0.1)
        with pytest.raises(TimeoutError):
            server.accept()  # nothing connected
    assert by_name.exit_code == 1 and "PermissionError: sandbox: socket.getaddrinfo is not allowed" in by_name.output
    assert by_address.exit_code == 1 and "PermissionError: sandbox: socket.__new__ is not allowed" in by_address.output


def test_the_ray_token_and_the_callers_environment_are_out_of_reach(tmp_path, monkeypatch):
    token = tmp_path / "auth_token"
    write_token(token)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    monkeypatch.setenv("RAY_AUTH_TOKEN", token.read_text())
    run = run_python(f"import os\nprint(sorted(os.environ))\nopen({str(token)!r}).read()", QUICK)
    assert run.exit_code == 1 and "PermissionError: sandbox: opening" in run.output
    assert token.read_text() not in run.output
    assert run.output.startswith(
        "['HOME', 'LANG', 'MKL_NUM_THREADS', 'OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'PATH', 'TMPDIR']\n"
    )
    listing = run_python(f"import os\nos.listdir({str(tmp_path)!r})", QUICK)
    assert "PermissionError: sandbox: listing" in listing.output


@pytest.mark.parametrize(
    "code",
    [
        "import os\nwhile True:\n    os.fork()",
        "import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])",
        "import _posixsubprocess\n_posixsubprocess.fork_exec()",
        "import os\nos.system('true')",
        "import ctypes\nctypes.CDLL('libc.so.6').fork()",
        "import ctypes\nctypes.CDLL(None).fork()",
    ],
    ids=["os.fork", "subprocess", "fork_exec", "system", "ctypes-libc", "ctypes-self"],
)
def test_no_process_can_be_started(code):
    run = run_python(code, QUICK)
    assert run.exit_code == 1 and "PermissionError: sandbox:" in run.output, run.output
    assert run.seconds < QUICK.wall_seconds


def test_memory_beyond_the_bound_is_a_memory_error():
    run = run_python("x = bytearray(8 * 2**30)", QUICK)
    assert run.exit_code == 1 and run.output.endswith("MemoryError\n")
    fits = run_python("len(bytearray(256 * 2**20))", QUICK)  # half the 512 MiB bound
    assert fits.ok and fits.output == f"{256 * 2**20}\n"


def test_a_flood_of_output_is_cut_at_the_file_bound():
    started = time.monotonic()
    run = run_python("import sys\nsys.stdout.write('x' * (100 * 2**20))", QUICK)
    assert time.monotonic() - started < QUICK.wall_seconds
    half = (QUICK.output_chars - len(CUT_MARK)) // 2
    assert run.cut and not run.ok and run.output.startswith("x" * half + CUT_MARK)
    assert run.exit_code == 120  # the interpreter could not even flush its output at exit


def test_writing_is_confined_to_the_calls_own_folder(tmp_path):
    outside = tmp_path / "escaped.txt"
    run = run_python(f"open({str(outside)!r}, 'w').write('x')", QUICK)
    assert run.exit_code == 1 and "PermissionError: sandbox: opening" in run.output and not outside.exists()
    for code in (f"import os\nos.remove({str(tmp_path)!r})", "import os\nos.symlink('/', 'root')"):
        assert "PermissionError: sandbox:" in run_python(code, QUICK).output
    inside = run_python("open('notes.txt', 'w').write('kept')\nopen('notes.txt').read()", QUICK)
    assert inside.ok and inside.output == "'kept'\n"
    # Each call has a folder of its own, removed afterwards: an empty tmpfs where the call
    # has mounts of its own, else the folder its code was written to.
    listing = run_python("import os\nsorted(os.listdir('.'))", QUICK)
    assert listing.output == ("[]\n" if listing.other_user else "['code.py']\n")


@pytest.mark.parametrize("code", ["import time\ntime.sleep(10**9)", "while True:\n    pass"], ids=["sleep", "spin"])
def test_a_call_that_never_ends_is_stopped_at_its_bound(code):
    run = run_python(code, QUICK)
    assert run.timed_out and not run.ok
    assert QUICK.cpu_seconds <= run.seconds < QUICK.wall_seconds + 1.0


def test_the_python_environment_answers_blocks_and_a_stuck_one_becomes_an_observation():
    environment = make_environment("python", {"timeout_s": 1, "output_chars": 100})
    prompts = [_prompt(0, "ab:"), _prompt(1, "cd:")]
    stuck = "<code>import time\ntime.sleep(60)</code>"
    engine = _Scripted(
        {0: [("<code>\n```python\n6*7\n```\n</code>", "stop"), ("42", "eos")], 1: [(stuck, "stop"), ("?", "eos")]}
    )
    engine.row_of = {tuple(TOKENIZER.encode("ab:")): 0, tuple(TOKENIZER.encode("cd:")): 1}
    params = SamplingParams(temperature=1.0, max_new_tokens=64, row_seeds=(1, 2))
    started = time.monotonic()
    answered, timed_out = run_episodes(engine, prompts, 1, params, environment, TOKENIZER, max_turns=4, max_tokens=200)
    assert time.monotonic() - started < 5
    observed = "<interpreter>\n42\n</interpreter>\n"
    assert TOKENIZER.decode(answered.token_ids) == "<code>\n```python\n6*7\n```\n</code>" + observed + "42\0"
    assert answered.model_mask.count(0) == len(observed) and (answered.tool_calls, answered.tool_errors) == (1, 0)
    timeout = "<interpreter>\nTimeoutError: the code ran out of its 1 s\n</interpreter>\n"
    assert TOKENIZER.decode(timed_out.token_ids) == stuck + timeout + "?\0"
    assert (timed_out.tool_calls, timed_out.tool_errors, timed_out.tool_timeouts, timed_out.turns) == (1, 1, 1, 2)
    assert EOS in answered.token_ids


def test_blocks_are_read_from_the_turn_and_options_are_checked():
    assert called_code("so <code>```py\nprint(1)\n```</code>") == "print(1)"
    assert called_code("<code>x = 1\nx</code>.") == "x = 1\nx"
    assert called_code("no block here") is None
    with pytest.raises(ValueError, match="takes no option 'timeout'; its options: timeout_s, memory_mb"):
        make_environment("python", {"timeout": 3})
    with pytest.raises(ValueError, match="memory_mb=8 must be a number of at least 64"):
        make_environment("python", {"memory_mb": 8})
    assert make_environment("python", {}).concurrent_steps == 4
    assert make_environment("python", {"workers": 16}).concurrent_steps == 16


SWITCH_THE_HOOK_OFF = """
import _thread
try:
    open('/etc/hostname')
except PermissionError as refused:
    frame = refused.__traceback__
    while frame.tb_next:
        frame = frame.tb_next
    frame.tb_frame.f_locals['busy'].add(_thread.get_ident())
print(open('/etc/hostname').read() != '')
"""
"""Code written to defeat the audit hook: it finds the hook's frame in a refusal's
traceback and marks its own thread as being checked already, so the hook lets it pass."""


def test_the_kernels_layers_hold_when_the_audit_hook_is_switched_off(tmp_path):
    probe = run_python(SWITCH_THE_HOOK_OFF, QUICK)
    assert probe.ok and probe.output == "True\n"  # the hook is off: /etc/hostname was read
    if not probe.other_user:
        pytest.skip(
            "this machine gives the sandbox no namespaces of its own (it needs root with CAP_SYS_ADMIN): "
            "only the audit hook and the resource limits stand"
        )
    token = tmp_path / "auth_token"
    write_token(token)
    outside = Path(tempfile.gettempdir()) / f"dapo-sandbox-escape-{os.getpid()}.txt"  # a folder anyone may write
    cases = {
        f"open({str(token)!r}).read()": "PermissionError: [Errno 13] Permission denied",
        f"open({str(outside)!r}, 'w')": "OSError: [Errno 30] Read-only file system",
        f"import os\nos.kill({os.getpid()}, 9)": "ProcessLookupError",  # the trainer is not even visible
        "import socket\nsocket.socket().connect(('127.0.0.1', 22))": "OSError: [Errno 101] Network is unreachable",
        "import os\nos.mknod('zero', 0o20666, os.makedev(1, 5))": "PermissionError: [Errno 1] Operation not permitted",
        "open('big', 'wb').write(bytes(2**20 - 1))\nopen('big2', 'wb').write(bytes(2**20 - 1))": "No space left",
    }
    limits = SandboxLimits(wall_seconds=3, cpu_seconds=2, folder_bytes=3 << 19, file_bytes=1 << 20)
    for code, refusal in cases.items():
        run = run_python(SWITCH_THE_HOOK_OFF + code, limits)
        assert run.exit_code == 1 and refusal in run.output, (code, run.output)
    assert not outside.exists()
    # A process started behind the hook's back, in a session of its own, ends with the call.
    escaped = run_python(
        SWITCH_THE_HOOK_OFF + "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(1000)\n", limits
    )
    assert escaped.ok
    time.sleep(0.2)
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and _uid_of(pid) == probe_uid()]
    assert left == []


def probe_uid() -> int:
    import pwd

    return pwd.getpwnam("nobody").pw_uid


def _uid_of(pid: str) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1
