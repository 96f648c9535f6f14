"""Stop signals and stop requests: how a run ends when SLURM (or a user) asks it to.

A signal during start-up abandons the start at once (:class:`StartupInterrupted`); one
while the run waits for generation abandons that generation (:class:`StopNow`) and the
run saves the last step it completed; one during the actor's work lets it finish, then
saves. :class:`StopRequest` catches the signals and bounds all of it by
``trainer.stop_grace_s``; the run ends with :class:`Preempted` (exit 75: requeue).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

logger = logging.getLogger(__name__)

PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")
"""What SLURM sends before it preempts or ends a job (``--signal`` chooses USR1 and when)."""


class StartupInterrupted(BaseException):
    """A preemption signal arrived while the system was starting: there is no step to
    finish and nothing to save, so the start is abandoned (everything it started is
    stopped, the Ray token removed) at once. Like ``KeyboardInterrupt`` it is not an
    ``Exception``: the handler raises it wherever the main thread happens to be, and code
    that catches ``Exception`` there (``logging`` does, around every write of a record)
    must not swallow it."""

    def __init__(self, signal_name: str, signum: int) -> None:
        super().__init__(f"received {signal_name} while the run was starting; everything it started was stopped")
        self.signal_name, self.signum = signal_name, signum


class StopNow(BaseException):
    """A preemption signal arrived while the run waited for generation (see
    :meth:`StopRequest.abortable`): what is being generated is abandoned, and the run
    saves the last step it completed. Not an ``Exception``, for the reason
    :class:`StartupInterrupted` is not."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(f"received {signal_name}: the generation in flight is abandoned")
        self.signal_name = signal_name


class StopOutOfTime(BaseException):
    """Stopping after a preemption signal (finishing the actor's work in flight, saving)
    took longer than ``trainer.stop_grace_s``: the run ends without that save, its
    previous checkpoint the latest, so that the job is requeued before SLURM kills it."""

    def __init__(self, signal_name: str, grace_s: float) -> None:
        super().__init__(
            f"stopping after {signal_name} took longer than trainer.stop_grace_s={grace_s:g} s; the run ended without "
            "saving the step in progress"
        )
        self.signal_name, self.grace_s = signal_name, grace_s


STOP_BACKSTOP_S = 60.0
"""After ``trainer.stop_grace_s``, how long the run's own clean-up may take (it stops its
workers, each within a bound) before the process exits regardless."""


class StopRequest:
    """Catches the preemption signals while a run is live. The first is remembered: the
    generation in flight, if the run is waiting for one, is abandoned at once
    (:meth:`abortable`), the actor's work in flight finishes, the last completed step is
    saved and the run stops; later ones are only logged, so a second signal cannot
    interrupt the save. All of it within ``grace_s`` (``trainer.stop_grace_s``): past it,
    the next signal handler call raises :class:`StopOutOfTime` wherever the main thread
    is, and :data:`STOP_BACKSTOP_S` later the process exits with status 75.

    Until :meth:`running` is called (the system is still starting: placing ranks, loading
    weights), a signal raises :class:`StartupInterrupted` instead: a start that waits on
    resources must not keep a job's allocation, or leave its files, after it was told to
    stop."""

    def __init__(self, grace_s: float = float("inf")) -> None:
        self.signal_name: Optional[str] = None
        self.starting = True
        self.interrupted: Optional[StartupInterrupted] = None
        self.grace_s = grace_s
        self.out_of_time = False
        self._saved = False  # the stop's checkpoint is written: the grace no longer interrupts
        self._abortable = False
        self._timers: list[threading.Timer] = []

    def running(self) -> None:
        """The system has started: from now on a signal stops the run after its step.
        Raises the :class:`StartupInterrupted` of a signal that arrived while starting (see
        :meth:`check_starting`)."""
        self.check_starting()
        self.starting = False

    def check_starting(self) -> None:
        """Raises the :class:`StartupInterrupted` of a signal that arrived while starting,
        in case something between the handler and here caught it (a library's ``except
        BaseException``): the start stops at the next stage instead of running on."""
        if self.interrupted is not None:
            raise self.interrupted

    @contextmanager
    def abortable(self) -> Iterator[None]:
        """Around a wait for generation that a stop may abandon: a signal that came before
        it or comes during it raises :class:`StopNow` (the caller keeps, or restores, the
        state from before the generation began)."""
        if self.signal_name is not None and not self.starting:
            raise StopNow(self.signal_name)
        self._abortable = True
        try:
            yield
        finally:
            self._abortable = False

    def __call__(self, signum, frame) -> None:
        import signal

        name = signal.Signals(signum).name
        if self.starting:
            if self.interrupted is None:
                self.interrupted = StartupInterrupted(name, signum)
            raise self.interrupted
        if self.out_of_time and not self._saved:
            self.out_of_time = False  # raised once; the clean-up that follows must run
            raise StopOutOfTime(self.signal_name, self.grace_s)
        if self.signal_name is not None:
            logger.warning("received %s again: already stopping; the checkpoint being written is kept", name)
            return
        self.signal_name = name
        self._start_grace_clock()
        if self._abortable:
            logger.warning(
                "received %s: abandoning the generation in flight, saving the last completed step and stopping "
                "(within trainer.stop_grace_s=%g s)",
                name,
                self.grace_s,
            )
            raise StopNow(name)
        logger.warning(
            "received %s: finishing the actor's work in flight, then saving a checkpoint and stopping (within "
            "trainer.stop_grace_s=%g s)",
            name,
            self.grace_s,
        )

    def _start_grace_clock(self) -> None:
        """At ``grace_s``: interrupt the main thread (a real signal, so that a blocking
        call returns) with :class:`StopOutOfTime`; :data:`STOP_BACKSTOP_S` later, exit."""
        import signal

        if self.grace_s == float("inf"):
            return
        main = threading.main_thread().ident

        def out_of_time() -> None:
            if self._saved:
                return
            logger.error("trainer.stop_grace_s=%g s have passed since the stop signal: ending the run", self.grace_s)
            self.out_of_time = True
            signal.pthread_kill(main, signal.SIGUSR1)

        def backstop() -> None:
            # Not through logging: its handlers' locks may be held by the main thread.
            os.write(2, f"the run's clean-up did not end within {STOP_BACKSTOP_S:g} s: exiting\n".encode())
            os._exit(75)

        self._timers = [
            threading.Timer(self.grace_s, out_of_time),
            threading.Timer(self.grace_s + STOP_BACKSTOP_S, backstop),
        ]
        for timer in self._timers:
            timer.daemon = True
            timer.start()

    def saved(self) -> None:
        """The stop's checkpoint is written: nothing is interrupted any more (the clean-up
        that follows stays under the backstop)."""
        self._saved = True
        if self._timers:
            self._timers[0].cancel()

    def cancel(self) -> None:
        """The run has ended: the grace clock stops."""
        self._saved = True
        for timer in self._timers:
            timer.cancel()

    @contextmanager
    def installed(self) -> Iterator[StopRequest]:
        import signal

        if threading.current_thread() is not threading.main_thread():
            yield self  # signals reach only the main thread; nothing to install
            return
        previous = {name: signal.signal(getattr(signal, name), self) for name in PREEMPTION_SIGNALS}
        try:
            yield self
        finally:
            self.cancel()
            for name, handler in previous.items():
                signal.signal(getattr(signal, name), handler)


class Preempted(Exception):
    """The run was asked to stop by a signal and saved a checkpoint of its last completed
    step (``abandoned``: the step whose generation was in flight, and abandoned)."""

    def __init__(self, signal_name: str, step: int, checkpoint: str, abandoned: Optional[int] = None) -> None:
        during = f" (step {abandoned}'s generation abandoned: it runs whole after --resume)" if abandoned else ""
        super().__init__(
            f"stopped by {signal_name} after step {step}{during}; checkpoint {checkpoint}; continue with --resume"
        )
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
