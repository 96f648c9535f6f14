"""Calling a group of Ray actors as one, and stopping them, the same way everywhere.

A failure in any member surfaces as one error that names which kind of member failed
and its own message (not Ray's wrapper); stopping never lets one dead member keep the
others running.
"""

from __future__ import annotations

import logging

import ray

logger = logging.getLogger(__name__)


def cause_of(exc: BaseException) -> BaseException:
    """The member's own exception inside Ray's wrapper (or ``exc`` itself)."""
    if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause:
        return exc.cause
    return exc


def call_all(refs: list, what: str) -> list:
    """``ray.get(refs)``; a member's exception is re-raised as RuntimeError naming ``what``."""
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as exc:
        raise RuntimeError(f"{what} failed: {cause_of(exc)}") from exc


def stop_all(actors: list, what: str, timeout_s: float = 60.0) -> None:
    """Ask every actor to ``shutdown()`` (bounded in time), then kill them all."""
    try:
        ray.get([actor.shutdown.remote() for actor in actors], timeout=timeout_s)
    except Exception as exc:  # a dead member must not stop the others' cleanup
        logger.warning("%s shutdown: %s", what, exc)
    for actor in actors:
        ray.kill(actor)
