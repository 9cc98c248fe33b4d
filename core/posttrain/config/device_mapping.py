"""``device_mapping``: a list of distinct device indices, or ``list(range(a, b[, step]))`` text.

The text form is matched by a regular expression and never evaluated.
"""

from __future__ import annotations

import re

MAX_DEVICE_INDEX = 65535
_RANGE = re.compile(r"^\s*list\(\s*range\(\s*(\d+)\s*(?:,\s*(\d+)\s*)?(?:,\s*(\d+)\s*)?\)\s*\)\s*$")


class DeviceMappingError(ValueError):
    pass


def parse_device_mapping(value: object) -> tuple[int, ...]:
    if isinstance(value, str):
        match = _RANGE.match(value)
        if not match:
            raise DeviceMappingError(
                f"text {value!r} is not of the form 'list(range(a, b[, step]))'"
            )
        numbers = [int(g) for g in match.groups() if g is not None]
        if len(numbers) == 1:
            numbers = [0, *numbers]
        if len(numbers) == 3 and numbers[2] == 0:
            raise DeviceMappingError("range step must be positive")
        if any(n > MAX_DEVICE_INDEX + 1 for n in numbers):
            raise DeviceMappingError(f"device indices above {MAX_DEVICE_INDEX} are not supported")
        devices = list(range(*numbers))
    elif isinstance(value, list | tuple):
        devices = list(value)
    else:
        raise DeviceMappingError(
            f"expected a list of device indices or 'list(range(a, b))', got {type(value).__name__}"
        )
    if not devices:
        raise DeviceMappingError("it maps no device")
    for d in devices:
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise DeviceMappingError(f"{d!r} is not a non-negative integer")
        if d > MAX_DEVICE_INDEX:
            raise DeviceMappingError(f"device index {d} is above the limit {MAX_DEVICE_INDEX}")
    if len(set(devices)) != len(devices):
        raise DeviceMappingError("device indices repeat")
    return tuple(devices)
