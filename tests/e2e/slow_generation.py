"""``dapo-megatron train`` whose rollout engines hang in every generation from step 2 on.

A generation far longer than a job's ``--signal`` lead time, as the 32B recipe's is:
each engine first sleeps :data:`HANG_S` in its own process (the driver waits on it as on
any generation), then generates. Run as ``python -m tests.e2e.slow_generation train ...``.
"""

from __future__ import annotations

import sys
import time

from dapo_megatron import cli
from dapo_megatron.orchestration.rollout import RolloutWorkers
from dapo_megatron.run.step import StepRunner

HANG_S = 120.0
_current = {"step": 0}
_real_generate, _real_step_generate = RolloutWorkers.generate, StepRunner._generate


def _hang(worker) -> None:
    time.sleep(HANG_S)


def _step_generate(self, step):
    _current["step"] = step
    return _real_step_generate(self, step)


def _generate(self, prompts, params, n):
    if _current["step"] >= 2:
        for engine in self.engines:
            engine.__ray_call__.remote(_hang)  # runs before the generation, in the engine's process
    return _real_generate(self, prompts, params, n)


if __name__ == "__main__":
    StepRunner._generate = _step_generate
    RolloutWorkers.generate = _generate
    sys.exit(cli.main(sys.argv[1:]))
