"""A preemption signal during start-up ends the start wherever it lands, and one after it
only asks the run to stop after its step."""

from __future__ import annotations

import logging
import signal

import pytest

from dapo_megatron.step import StartupInterrupted, StopRequest


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
