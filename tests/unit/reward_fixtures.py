"""User reward functions named as module:function by the reward tests."""

import time


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
    """What the response asks for: a NaN, an infinity, NumPy numbers, bools."""
    import numpy as np

    return {
        "nan": float("nan"),
        "inf": float("-inf"),
        "np_nan": np.float32("nan"),
        "np_float": np.float32(1.0),
        "np_int": np.int64(-1),
        "true": True,
        "np_false": np.bool_(False),
    }[response]
