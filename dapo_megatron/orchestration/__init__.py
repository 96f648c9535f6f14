"""Ray orchestration: the cluster, the actor's ranks and the rollout engines as Ray actors.

This package is the only place that imports Ray. The trainer talks to
:class:`ActorGroup` and :class:`RolloutWorkers`, which hide where work runs and hand back
one result per call; Ray handles, placement groups and the weight hand-off live here.
"""
