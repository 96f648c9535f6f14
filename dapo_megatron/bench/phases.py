"""The phases ``bench`` measures, by name (light: the CLI lists them in its help)."""

PHASE_HELP = {
    "generate": "the engines sample responses",
    "logprob": "the actor's old-log-prob pass",
    "train": "the DAPO updates",
    "sync": "weight sync into the engines",
    "reward": "the reward function over a mix of responses",
    "step": "whole trainer steps",
}
"""Every phase, in the order they run, with what it times."""

PHASES = tuple(PHASE_HELP)
