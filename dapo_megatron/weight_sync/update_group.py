"""A process group separate from the actor's default one, for streaming weights to engines.

When engines do not share the actor's GPUs, a trainer-side sender and every engine rank
form their own group: the sender is rank 0, engine ranks follow (SGLang's
``init_weights_update_group`` with ``rank_offset=1``). Both ends build it the same way,
with their own TCP rendezvous and store prefix, so it never touches the actor's groups.
It lives in the runtime layer because both the actor (sender) and the engines
(receivers) use it. Its store listens on the sender's address only and every member's
gloo listener on the interface it reaches that address from, as the actor's own groups
(:mod:`dapo_megatron.runtime.distributed`): never on every interface.
"""

from __future__ import annotations

import datetime
from typing import Optional


def init_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "nccl",
    timeout: Optional[datetime.timedelta] = None,
):
    """Join (or, as rank 0, host) a process group separate from the default one.

    torch has no public API for a second, independent group across processes that do not
    share the default group; this uses the same torch internals SGLang uses for its end.
    """
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    from dapo_megatron.runtime.distributed import gloo_interface, rendezvous_store

    timeout = timeout or datetime.timedelta(minutes=10)
    store = rendezvous_store(master_address, master_port, world_size, host=rank == 0, timeout=timeout)
    with gloo_interface(master_address):
        group, _ = _new_process_group_helper(
            world_size,
            rank,
            [],
            Backend(backend),
            PrefixStore(group_name, store),
            group_name=group_name,
            timeout=timeout,
        )
    # Collectives name ranks as "global" ranks; in this group they are the group ranks
    # (SGLang's side does the same, so src=0 means the sender on both ends).
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group
