"""``python``: a sandboxed Python interpreter as the model's tool, for tool-integrated math
(ReTool's recipe: the model reasons in text, writes code when computing is easier, reads
the output, and goes on).

The model writes ``<code>...</code>`` (the turn ends at ``</code>``; a Markdown fence
inside, ```` ```python ````, is dropped); the block runs in a fresh sandboxed interpreter
(``sandbox.py``: no network, no new processes, a private folder, CPU, memory, file and
wall-clock bounds), and the episode answers ``<interpreter>OUTPUT</interpreter>``: what
the block printed, the value of its last line if that is an expression (as a notebook
shows it), or its traceback. Each block runs on its own: nothing carries from one call to
the next, so a block defines what it uses. A turn without a block ends the episode; the
run's ``reward_fn`` scores the whole trajectory's text.

A block that overruns its time is answered ``TimeoutError`` and counted as a timeout; one
that fails (an exception, a refused operation, memory) is counted as a tool error. Output
beyond ``output_chars`` is cut and says so.
"""

from __future__ import annotations

from typing import Optional

from dapo_megatron.data import Prompt
from dapo_megatron.sampling.environments.base import Environment, Episode, Observation, tagged_call
from dapo_megatron.sampling.environments.sandbox import SandboxLimits, SandboxRun, run_python

_FENCES = ("```python", "```py", "```")


def called_code(turn_text: str) -> Optional[str]:
    """The code of the turn's block (its Markdown fence dropped), or None without one."""
    code = tagged_call(turn_text, "<code>", "</code>")
    if code is None:
        return None
    code = code.strip()
    for fence in _FENCES:
        if code.startswith(fence):
            code = code[len(fence) :]
            break
    if code.endswith("```"):
        code = code[:-3]
    return code.strip("\n")


def observation_text(run: SandboxRun, limits: SandboxLimits) -> str:
    """What the model reads after a block ran."""
    output = run.output
    if run.cut:
        output += f"\n[output cut: more than {limits.output_chars} characters]"
    if run.timed_out:
        output += f"\nTimeoutError: the code ran out of its {limits.wall_seconds:g} s"
    return f"<interpreter>\n{output.strip()}\n</interpreter>\n"


class PythonEpisode(Episode):
    """One prompt's episode: runs each block, ends at a turn without one."""

    def __init__(self, limits: SandboxLimits) -> None:
        self.limits = limits

    def step(self, turn_ids: list[int], turn_text: str) -> Observation:
        code = called_code(turn_text)
        if code is None:
            return Observation(done=True)
        run = run_python(code, self.limits)
        return Observation(
            text=observation_text(run, self.limits),
            tool_calls=1,
            tool_errors=int(not run.ok),
            tool_timeouts=int(run.timed_out),
        )


class PythonEnvironment(Environment):
    """A sandboxed interpreter as a tool (see the module docstring); its options are
    ``rollout.env_options``."""

    stop_strings = ("</code>",)

    def __init__(
        self,
        timeout_s: float = 10.0,
        memory_mb: int = 1024,
        output_chars: int = 1000,
        file_mb: int = 1,
        workers: int = 4,
    ) -> None:
        """``timeout_s``: wall-clock and CPU time of a block; ``memory_mb``: its address
        space; ``output_chars``: what of its output the model reads; ``file_mb``: the
        largest file (its output included) it may write; ``workers``: blocks run at once
        (each a process; on the machine that runs the trainer's sampler)."""
        for name, value, least in (
            ("timeout_s", timeout_s, 0.1),
            ("memory_mb", memory_mb, 64),
            ("output_chars", output_chars, 1),
            ("file_mb", file_mb, 1),
            ("workers", workers, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < least:
                raise ValueError(f"{name}={value!r} must be a number of at least {least}")
        self.concurrent_steps = int(workers)
        self.limits = SandboxLimits(
            wall_seconds=float(timeout_s),
            cpu_seconds=max(1, int(-(-timeout_s // 1))),
            memory_bytes=int(memory_mb) << 20,
            file_bytes=int(file_mb) << 20,
            output_chars=int(output_chars),
        )

    def start(self, prompt: Prompt) -> Episode:
        return PythonEpisode(self.limits)

    def describe(self) -> str:
        limits = self.limits
        return (
            f"each block a sandboxed process of at most {limits.memory_bytes / 2**30:g} GiB of address space and "
            f"{limits.wall_seconds:g} s; {self.concurrent_steps} at once on the node that runs the trainer: up to "
            f"{self.concurrent_steps * limits.memory_bytes / 2**30:g} GiB and {self.concurrent_steps} CPU cores there"
        )
