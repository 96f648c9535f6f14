"""Starts a Ray worker of the placement rehearsal's simulated cluster, without importing Ray.

A raylet launches each worker through a *setup* script that applies the worker's runtime
environment and then replaces itself with the real worker (``default_worker.py``). Ray's
own setup script imports Ray to do so, which costs about as much CPU as the worker itself
(about a second here); the rehearsal starts one worker per rank and engine (160 for the
32B recipe) on the machine it runs on, so it points its raylets here instead
(``setup_worker_path``). This script does the same for the Python workers the rehearsal
starts, whose runtime environments are environment variables only: it sets them, as Ray
does (``${VAR}`` expanded, unknown ones empty), and execs the worker with the remaining
arguments. Anything it does not handle (another language, a command prefix) it refuses,
so that a rehearsal never starts a worker differently from Ray without saying so.
"""

from __future__ import annotations

import json
import os
import re
import sys


def worker_command(argv: list[str], environ: dict) -> tuple[list[str], dict[str, str]]:
    """The worker's command line and the environment variables to set, from the setup
    script's arguments (``--serialized-runtime-env-context=JSON``, ``--language=PYTHON``,
    then the worker's own arguments)."""
    context: dict = {}
    language = "PYTHON"
    rest: list[str] = []
    args = iter(argv)
    for arg in args:
        key, has_value, value = arg.partition("=")
        if key in ("--serialized-runtime-env-context", "--language"):
            value = value if has_value else next(args)
            if key == "--language":
                language = value
            else:
                context = json.loads(value or "{}")
        else:
            rest.append(arg)
    if language != "PYTHON" or context.get("command_prefix") or context.get("java_jars"):
        raise SystemExit(f"the rehearsal's worker setup handles plain Python workers only, not {language} {context}")
    env = {}
    for name, raw in (context.get("env_vars") or {}).items():
        expanded = os.path.expandvars(raw)
        env[name] = re.sub(r"\$\{[A-Z0-9_]+\}", "", expanded)
    if context.get("override_worker_entrypoint"):
        rest[0] = context["override_worker_entrypoint"]
    executable = context.get("py_executable") or sys.executable
    return [executable, *rest], env


if __name__ == "__main__":
    command, env = worker_command(sys.argv[1:], dict(os.environ))
    os.environ.update(env)
    os.execv(command[0], command)
