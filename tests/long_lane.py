"""The long lane (docs/testing.md): tests marked `slow`, which `python -m pytest` leaves out (addopts'
`-m "not slow"`) and `python -m pytest -m slow` runs; CI runs both lanes, so every test runs there.

What goes there: several processes, meshes of several devices compared with one device, the rest of a
sweep over the Pallas kernels in interpret mode once its first cases run in the default lane, and trainer
command lines in subprocesses whose behaviour the default lane also tests in the process. A test module
keeps its basic behaviour in the default lane.
"""

import pytest

__all__ = ["SLOW", "parametrize"]

SLOW = pytest.mark.slow


def parametrize(names: str, values, *, default=1, **kwargs):
    """pytest.mark.parametrize(names, values, **kwargs) whose first `default` values (or the values at
    the indices in `default`, a collection) run in the default lane and the others in the long lane."""
    keep = range(default) if isinstance(default, int) else default
    several = len([n for n in names.split(",") if n.strip()]) > 1
    params = []
    for i, value in enumerate(values):
        if i in keep:
            params.append(value)
        elif isinstance(value, type(pytest.param(None))):
            params.append(pytest.param(*value.values, marks=[*value.marks, SLOW], id=value.id))
        else:
            params.append(pytest.param(*(value if several else (value,)), marks=SLOW))
    return pytest.mark.parametrize(names, params, **kwargs)
