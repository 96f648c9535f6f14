"""The checkpoint's optimizer-state workarounds touch torch's Adam only.

They exist for torch Adam's per-parameter ``step`` (the CPU runtime's optimizer). On a
GPU megatron builds Transformer Engine's FusedAdam, which keeps the step in the param
group; a per-parameter ``step`` in its state makes its ``state_dict`` raise
``KeyError('step')``. A stand-in with FusedAdam's layout (an Optimizer that is not torch's
Adam) must come out of all three untouched.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dapo_megatron.actor import checkpoint


class FusedAdamLike(torch.optim.Optimizer):
    """FusedAdam's state layout: moments per parameter, the step in the param group."""

    def __init__(self, params):
        super().__init__(params, {"lr": 1e-3, "step": 0})


def wrapped(inner):
    return SimpleNamespace(
        chained_optimizers=[SimpleNamespace(optimizer=inner, config=SimpleNamespace(), model_param_group_index_map={})]
    )


def test_fused_adam_is_left_alone():
    param = torch.nn.Parameter(torch.ones(3))
    fused = FusedAdamLike([param])
    optimizer = wrapped(fused)
    checkpoint._materialize_optimizer_state(optimizer)
    assert dict(fused.state) == {}
    with checkpoint._torch_adam_step_passthrough(optimizer):
        assert not hasattr(optimizer.chained_optimizers[0], "_set_main_param_and_optimizer_states")
    fused.state[param] = {"exp_avg": torch.zeros(3)}
    checkpoint._unshare_adam_steps(optimizer)
    assert set(fused.state[param]) == {"exp_avg"}


def test_torch_adam_gets_its_state_and_unshared_steps():
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    adam = torch.optim.Adam(params)
    optimizer = wrapped(adam)
    checkpoint._materialize_optimizer_state(optimizer)
    assert all(set(adam.state[p]) == {"step", "exp_avg", "exp_avg_sq"} for p in params)
    shared = torch.tensor(5.0)
    for p in params:
        adam.state[p]["step"] = shared
    checkpoint._unshare_adam_steps(optimizer)
    steps = [adam.state[p]["step"] for p in params]
    assert steps[0] is not steps[1] and all(float(s) == 5.0 for s in steps)
