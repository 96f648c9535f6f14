"""Calling a group of Ray actors as one, and stopping them, the same way everywhere.

A failure in any member surfaces as one error that names which member failed and its
own message (not Ray's wrapper), as soon as it happens: results are awaited in the
order they finish, so a member that died (its process killed) is reported within
seconds even while the others wait for it inside a collective, instead of after the
collective's timeout. A member Ray has not even started (no node has what it asks
for free) is named as "not started" after a bounded wait, instead of being waited for
forever; a call given a bound names the members that have not answered within it (a
hung engine fails the step instead of holding the job until its time limit). Stopping never lets one dead or stuck member keep the others running.
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


class MemberTimedOut(MemberFailed):
    """A member of a group did not answer a call within its bound; the message names it
    and the setting that bounds the call."""


def call_all(
    refs: list,
    what: str,
    names: Optional[list[str]] = None,
    members: Optional[list] = None,
    asked: str = "",
    schedule_timeout_s: Optional[float] = None,
    timeout_s: Optional[float] = None,
    timeout_key: str = "",
) -> list:
    """``ray.get(refs)``, failing on the first member that raises or dies.

    The error is a :class:`MemberFailed` naming the member (``names[i]``, else ``what``)
    and its own exception, or how its process died. With ``members`` (the actor of each
    ref), a member still waiting for Ray to place it after ``schedule_timeout_s``
    (default :data:`SCHEDULE_TIMEOUT_S`) fails the call as "not started", with
    ``asked`` (what it asks for) and what the cluster has free; the wait goes on while
    members keep starting, and fails once none has for ``schedule_timeout_s``. With
    ``timeout_s``, members that have not answered that long after the call are named as
    hung (:class:`MemberTimedOut`), with ``timeout_key``, the setting that bounds them.
    """
    position = {ref: index for index, ref in enumerate(refs)}
    results: list = [None] * len(refs)
    pending = list(refs)
    limit = SCHEDULE_TIMEOUT_S if schedule_timeout_s is None else schedule_timeout_s
    start = time.monotonic()
    deadline = start + limit if members is not None else None
    work_deadline = start + timeout_s if timeout_s is not None else None
    not_started = len(refs)
    while pending:
        ends = [d for d in (deadline, work_deadline) if d is not None]
        wait_s = POLL_S if not ends else min(POLL_S, max(0.0, min(ends) - time.monotonic()))
        done, pending = _wait(pending, wait_s)
        now = time.monotonic()
        if not done and not any(now >= end for end in ends):
            continue  # a poll: back in Python, where a signal's handler runs (ray.wait defers it)
        if not done and work_deadline is not None and now >= work_deadline:
            hung = [names[position[ref]] if names else what for ref in pending]
            raise MemberTimedOut(
                f"{', '.join(hung[:4])}{', ...' if len(hung) > 4 else ''} did not answer within {timeout_s:g} s"
                f"{f' ({timeout_key})' if timeout_key else ''}: hung, or slower than that setting allows"
            )
        if not done:
            waiting = [(names[position[ref]] if names else what, members[position[ref]]) for ref in pending]
            unplaced = unscheduled(waiting)
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
                more, _ = _wait(pending, DEATH_GRACE_S, num_returns=len(pending))
                for other in more:
                    _, died = _outcome(other, names[position[other]] if names else what)
                    if died is not None and isinstance(died.__cause__, ray.exceptions.RayActorError):
                        raise MemberFailed(f"{died}; then {failure}") from died.__cause__
            raise failure
    return results


POLL_S = 1.0
"""How long one ``ray.wait`` of a call blocks at most, so that a signal's handler runs
within this many seconds wherever Ray's wait would defer it."""


def _wait(pending: list, timeout_s: float, num_returns: int = 1) -> tuple[list, list]:
    """``ray.wait`` for one of ``pending``. A signal handler's exception raised while Ray's
    C++ wait checks for signals (a stop abandoning a generation: not an ``Exception``)
    comes out of Cython as a SystemError whose cause it is: re-raised as itself."""
    try:
        return ray.wait(pending, num_returns=num_returns, timeout=timeout_s)
    except SystemError as exc:
        if isinstance(exc.__cause__, BaseException) and not isinstance(exc.__cause__, Exception):
            raise exc.__cause__ from None
        raise


SCHEDULE_TIMEOUT_S = 120.0
"""How long a group's start waits, with no member starting, for Ray to place the members
it has not started before naming them (a start that keeps making progress, many
processes on few cores, goes on; a member that was placed may take longer: its own work
is not bounded here)."""

CONTROL_TIMEOUT_S = 300.0
"""The bound of a call that only controls a member (its memory, its weight version, its
health): seconds of work at most; past this it is hung."""

_NOT_STARTED = ("PENDING_CREATION", "DEPENDENCIES_UNREADY")


def unscheduled(waiting: list[tuple[str, Any]]) -> list[str]:
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


SHUTDOWN_TIMEOUT_S = 15.0
"""How long a group's members have to shut down before they are killed."""


def stop_all(actors: list, what: str, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Ask every actor to ``shutdown()`` (within ``timeout_s``; 0: do not wait, a member
    known to be busy would answer only after its call), then kill them all."""
    if timeout_s > 0:
        try:
            ray.get([actor.shutdown.remote() for actor in actors], timeout=timeout_s)
        except Exception as exc:  # a dead member must not stop the others' cleanup
            logger.warning("%s shutdown: %s", what, exc)
    for actor in actors:
        ray.kill(actor)
