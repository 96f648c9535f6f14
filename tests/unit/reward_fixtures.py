"""User reward functions named as module:function by the reward tests.

``REWARD_FIXTURE_START`` makes importing this module in a reward worker (a child
process; never in the test process itself, which imports it too) ``exit`` at once or
``hang``: a worker that dies or never comes up during start-up.
"""

import multiprocessing
import os
import time

if multiprocessing.parent_process() is not None:
    if os.environ.get("REWARD_FIXTURE_START") == "exit":
        os._exit(1)
    if os.environ.get("REWARD_FIXTURE_START") == "hang":
        time.sleep(60)


def hangs(response: str, ground_truth: str) -> float:
    time.sleep(60)
    return 1.0


def slow_on_marker(response: str, ground_truth: str) -> float:
    if "SLOW" in response:
        time.sleep(60)
    return 1.0 if response.strip() == ground_truth else -1.0


def raises(response: str, ground_truth: str) -> float:
    raise KeyError("boom")


def returns_dict(response: str, ground_truth: str) -> dict:
    return {"score": 0.5, "prediction": response[:3]}


def returns_string(response: str, ground_truth: str) -> str:
    return "yes"


def returns_by_request(response: str, ground_truth: str):
    """What the response asks for: a NaN, an infinity, a huge or a bounded finite number,
    NumPy numbers, bools."""
    import numpy as np

    return {
        "nan": float("nan"),
        "inf": float("-inf"),
        "huge": 1e308,
        "neg_huge": -1e308,
        "at_bound": 1e6,
        "neg_at_bound": -1e6,
        "np_nan": np.float32("nan"),
        "np_float": np.float32(1.0),
        "np_int": np.int64(-1),
        "true": True,
        "np_false": np.bool_(False),
    }[response]


def allocates_on_marker(response: str, ground_truth: str) -> float:
    """Allocates 4 GiB when the response says ``BIG``."""
    if response == "BIG":
        data = b"x" * (4 << 30)
        return float(len(data) > 0)
    return 1.0 if response.strip() == ground_truth else -1.0
