"""Calling a group of Ray actors as one, and stopping them, the same way everywhere.

A failure in any member surfaces as one error that names which member failed and its
own message (not Ray's wrapper), as soon as it happens: results are awaited in the
order they finish, so a member that died (its process killed) is reported within
seconds even while the others wait for it inside a collective, instead of after the
collective's timeout. A member Ray has not even started (no node has what it asks
for free) is named as "not started" after a bounded wait, instead of being waited for
forever. Stopping never lets one dead or stuck member keep the others running.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import ray

logger = logging.getLogger(__name__)


def cause_of(exc: BaseException) -> BaseException:
    """The member's own exception inside Ray's wrapper (or ``exc`` itself)."""
    if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause:
        return exc.cause
    return exc


class MemberFailed(RuntimeError):
    """A member of a group raised or died; the message names it."""


def call_all(
    refs: list,
    what: str,
    names: Optional[list[str]] = None,
    members: Optional[list] = None,
    asked: str = "",
    schedule_timeout_s: Optional[float] = None,
) -> list:
    """``ray.get(refs)``, failing on the first member that raises or dies.

    The error is a :class:`MemberFailed` naming the member (``names[i]``, else ``what``)
    and its own exception, or how its process died. With ``members`` (the actor of each
    ref), a member still waiting for Ray to place it after ``schedule_timeout_s``
    (default :data:`SCHEDULE_TIMEOUT_S`) fails the call as "not started", with
    ``asked`` (what it asks for) and what the cluster has free; the wait goes on while
    members keep starting, and fails once none has for ``schedule_timeout_s``.
    """
    position = {ref: index for index, ref in enumerate(refs)}
    results: list = [None] * len(refs)
    pending = list(refs)
    limit = SCHEDULE_TIMEOUT_S if schedule_timeout_s is None else schedule_timeout_s
    start = time.monotonic()
    deadline = start + limit if members is not None else None
    not_started = len(refs)
    while pending:
        wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
        if not done:
            waiting = [(names[position[ref]] if names else what, members[position[ref]]) for ref in pending]
            unplaced = _unscheduled(waiting)
            if not unplaced:
                deadline = None  # every member has started: wait for their work as before
            elif len(unplaced) < not_started:
                # Members are still starting (many processes on few cores): wait while any does.
                not_started, deadline = len(unplaced), time.monotonic() + limit
            else:
                raise _not_started(unplaced, len(refs), what, asked, time.monotonic() - start, limit)
            continue
        for ref in done:
            results[position[ref]], failure = _outcome(ref, names[position[ref]] if names else what)
            if failure is None:
                continue
            if not isinstance(failure.__cause__, ray.exceptions.RayActorError) and pending:
                # A member that raised may only be reacting to a peer that died (a
                # collective whose connection closed): if one did, name it first.
                more, _ = ray.wait(pending, num_returns=len(pending), timeout=DEATH_GRACE_S)
                for other in more:
                    _, died = _outcome(other, names[position[other]] if names else what)
                    if died is not None and isinstance(died.__cause__, ray.exceptions.RayActorError):
                        raise MemberFailed(f"{died}; then {failure}") from died.__cause__
            raise failure
    return results


SCHEDULE_TIMEOUT_S = 120.0
"""How long a group's start waits, with no member starting, for Ray to place the members
it has not started before naming them (a start that keeps making progress, many
processes on few cores, goes on; a member that was placed may take longer: its own work
is not bounded here)."""

_NOT_STARTED = ("PENDING_CREATION", "DEPENDENCIES_UNREADY")


def _unscheduled(waiting: list[tuple[str, Any]]) -> list[str]:
    """The names of the members of ``waiting`` (name, actor) that Ray has not started:
    no node has their resources free, or their worker process has not come up yet."""
    from ray._private import state

    unplaced = []
    for name, actor in waiting:
        entry = state.actors(actor_id=actor._actor_id.hex())
        if entry and entry.get("State") in _NOT_STARTED:
            unplaced.append(name)
    return unplaced


def _not_started(
    unplaced: list[str], total: int, what: str, asked: str, waited_s: float, quiet_s: float
) -> MemberFailed:
    """The error naming members Ray has not started, none of them for ``quiet_s``."""
    free, total_resources = ray.available_resources(), ray.cluster_resources()
    have = ", ".join(f"{free.get(k, 0.0):g} {k} free of {total_resources.get(k, 0.0):g}" for k in ("CPU", "GPU"))
    quiet = "" if waited_s < quiet_s + 1 else f", none of them in the last {quiet_s:.0f} s"
    return MemberFailed(
        f"{len(unplaced)} of {total} {what}(s) not started after {waited_s:.0f} s{quiet} ({', '.join(unplaced[:4])}"
        f"{', ...' if len(unplaced) > 4 else ''}): Ray has not started them (nothing free that they ask for, "
        "or their processes are still starting)"
        f"{f' (each asks for {asked})' if asked else ''}; the cluster has {have} on "
        f"{len([n for n in ray.nodes() if n['Alive']])} node(s)"
    )


DEATH_GRACE_S = 5.0
"""How long a failure waits to see whether a peer died (Ray reports a death in about a second)."""


def _outcome(ref, member: str) -> tuple[Any, Optional[MemberFailed]]:
    """The member's result, or its failure as a MemberFailed (its cause attached)."""
    try:
        return ray.get(ref), None
    except ray.exceptions.RayTaskError as exc:
        failure, cause = MemberFailed(f"{member} failed: {cause_of(exc)}"), exc
    except ray.exceptions.RayActorError as exc:
        failure, cause = MemberFailed(f"{member} died: {_death(exc)}"), exc
    failure.__cause__ = cause
    return None, failure


def _death(exc: BaseException) -> str:
    """Ray's account of a dead actor, on one line."""
    text = " ".join(str(exc).split())
    return text[:600]


def stop_all(actors: list, what: str, timeout_s: float = 15.0) -> None:
    """Ask every actor to ``shutdown()`` (bounded in time), then kill them all."""
    try:
        ray.get([actor.shutdown.remote() for actor in actors], timeout=timeout_s)
    except Exception as exc:  # a dead member must not stop the others' cleanup
        logger.warning("%s shutdown: %s", what, exc)
    for actor in actors:
        ray.kill(actor)
