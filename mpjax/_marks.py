"""Which function an autocast function wraps, marked on it: `mpjax.audit` and
`mpjax.diagnose` read the original to count the casts autocast adds."""

from __future__ import annotations

import weakref


class _Mark:
    """What `marked` sets: the wrapper, weakly, and the function it wraps. It
    pickles (cloudpickle ships an autocast function by value) as the two."""

    def __init__(self, wrapper, fun, region=None):
        self.wrapper, self.fun, self.region = weakref.ref(wrapper), fun, region

    def __reduce__(self):
        return _Mark, (self.wrapper(), self.fun, self.region)


def marked(wrapper, fun, region=None):
    """`wrapper`, marked as autocast's of `fun` (`original_of` reads it): `audit`
    counts the casts autocast adds. The mark names `wrapper` itself, since
    functools.wraps in other transforms (jax.grad) copies attributes onward, and
    weakly: a cycle would keep a dropped function and its closed-over arrays alive
    until Python's cycle collector runs."""
    wrapper.__mpjax_autocast__ = _Mark(wrapper, fun, region)
    return wrapper


def original_of(fun):
    """The function `autocast` wrapped into `fun`, or None if `fun` is no autocast
    function (a transform of one, jax.grad(autocast(f)), is not)."""
    mark = getattr(fun, "__mpjax_autocast__", None)
    return mark.fun if isinstance(mark, _Mark) and mark.wrapper() is fun else None


def region_of(fun):
    """The `mpjax._regions.Region` autocast runs `fun` under, if `fun` is an autocast
    function (as for `original_of`), else None."""
    mark = getattr(fun, "__mpjax_autocast__", None)
    return mark.region if isinstance(mark, _Mark) and mark.wrapper() is fun else None
