"""A preemption signal during start-up ends the start wherever it lands, and one after it
only asks the run to stop after its step."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest

from dapo_megatron.run.signals import StartupInterrupted, StopNow, StopOutOfTime, StopRequest


class _SignalDuringWrite(logging.Handler):
    """A handler whose write is where the signal arrives (as in a log line to stdout)."""

    def __init__(self, stop: StopRequest) -> None:
        super().__init__()
        self.stop = stop

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.stop(signal.SIGTERM, None)
        except Exception:
            self.handleError(record)  # what logging.StreamHandler does with a failing write


def test_a_signal_inside_a_log_write_during_start_up_is_not_swallowed():
    stop = StopRequest()
    logger = logging.getLogger("dapo_megatron.test_stop_request")
    handler = _SignalDuringWrite(stop)
    logger.addHandler(handler)
    try:
        with pytest.raises(StartupInterrupted, match="received SIGTERM while the run was starting") as caught:
            logger.warning("placing the actor's ranks")
    finally:
        logger.removeHandler(handler)
    assert caught.value.signum == signal.SIGTERM


def test_a_start_up_signal_caught_on_the_way_is_raised_again_before_the_run_goes_on():
    stop = StopRequest()
    try:
        stop(signal.SIGUSR1, None)
    except BaseException:  # a library that catches everything
        pass
    with pytest.raises(StartupInterrupted, match="received SIGUSR1") as caught:
        stop.check_starting()
    assert caught.value.signum == signal.SIGUSR1
    with pytest.raises(StartupInterrupted):
        stop.running()
    assert stop.starting and stop.signal_name is None


def test_after_start_up_a_signal_only_asks_for_a_stop_after_the_step():
    stop = StopRequest()
    stop.running()
    stop(signal.SIGTERM, None)
    stop(signal.SIGUSR1, None)  # a second one is only logged
    assert stop.signal_name == "SIGTERM" and stop.interrupted is None


def test_a_signal_abandons_a_wait_for_generation_during_or_before_it():
    stop = StopRequest()
    stop.running()
    with pytest.raises(StopNow, match="received SIGUSR1: the generation in flight is abandoned"):
        with stop.abortable():
            stop(signal.SIGUSR1, None)  # arrives while the run waits for the engines
    assert stop.signal_name == "SIGUSR1"
    with pytest.raises(StopNow):  # a signal that came during the actor's work: the next wait is not begun
        with stop.abortable():
            pytest.fail("the wait began after a stop")
    outside = StopRequest()
    outside.running()
    outside(signal.SIGTERM, None)  # outside a wait: only remembered
    assert outside.signal_name == "SIGTERM"


def test_stopping_past_the_grace_interrupts_the_main_thread_and_the_save_cancels_it():
    """At ``grace_s`` after the signal a real signal reaches the main thread, whose handler
    raises StopOutOfTime even inside a blocking call; a stop that saved in time is not
    interrupted."""
    stop = StopRequest(grace_s=0.3)
    with stop.installed():
        stop.running()
        os.kill(os.getpid(), signal.SIGUSR1)
        start = time.monotonic()
        with pytest.raises(StopOutOfTime, match=r"took longer than trainer.stop_grace_s=0.3 s"):
            threading.Event().wait(30)  # blocks in a lock acquire, as a wait for a member does
        assert 0.25 < time.monotonic() - start < 10
    assert all(timer.finished.is_set() for timer in stop._timers)  # the backstop went with the run

    saved = StopRequest(grace_s=0.3)
    with saved.installed():
        saved.running()
        os.kill(os.getpid(), signal.SIGUSR1)
        saved.saved()
        threading.Event().wait(1.0)  # nothing is raised
