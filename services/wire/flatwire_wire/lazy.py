"""`lazy`: functools.cached_property without its lock (Python 3.11 takes one on every first read), for the views
the hops create per message: a value computed on first read and kept in the instance."""

from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")
R = TypeVar("R")


class lazy(Generic[T, R]):  # noqa: N801  (used like property)
    def __init__(self, compute: Callable[[T], R]):
        self.compute = compute
        self.name = compute.__name__
        self.__doc__ = compute.__doc__

    @overload
    def __get__(self, instance: None, owner: Any) -> "lazy[T, R]": ...

    @overload
    def __get__(self, instance: T, owner: Any) -> R: ...

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        value = instance.__dict__[self.name] = self.compute(instance)  # found there from now on
        return value
