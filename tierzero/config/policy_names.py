"""Prefetch policy names, checked where the config is built, without importing the prefetcher:
a built-in name, a dotted path to a policy class (imported and its constructor checked against
the options), or an object with a `plan(view)` method (tierzero.prefetch.PrefetchPolicy)."""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Iterable, Mapping, Protocol, runtime_checkable

BUILTIN_POLICIES = ("none", "lookahead", "bytes", "adaptive")
"""Names of the built-in policies in `PrefetchConfig.policy`."""


@runtime_checkable
class _Plans(Protocol):
    def plan(self, view: Any) -> Iterable[Any]: ...


def check_policy(policy: Any, options: Mapping[str, Any]) -> None:
    """ValueError unless `policy` is a built-in name, an importable dotted path to a policy class
    whose constructor takes `options`, or a policy object (config validation)."""
    if isinstance(policy, str):
        if policy in BUILTIN_POLICIES:
            if options:
                raise ValueError(f"prefetch.options: only for a policy class named by dotted path; the "
                                 f"built-in {policy!r} takes depth, reserve and nvme_depth, got {dict(options)!r}")
            return
        if "." not in policy and ":" not in policy:
            raise ValueError(f"prefetch.policy: expected one of {', '.join(map(repr, BUILTIN_POLICIES))}, "
                             "a dotted path to a tz.PrefetchPolicy class ('package.module.Class'), or a "
                             f"policy object; got {policy!r}")
        load_policy_class(policy, options)
        return
    if isinstance(policy, type):
        raise ValueError(f"prefetch.policy: got the class {policy.__name__}; pass an object, "
                         f"{policy.__name__}(...), or its dotted path as a string")
    if not isinstance(policy, _Plans):
        raise ValueError(f"prefetch.policy: expected a built-in name, a dotted path or an object "
                         f"implementing tz.PrefetchPolicy (a plan(view) method); got {policy!r}")
    if options:
        raise ValueError(f"prefetch.options: only for a policy class named by dotted path, got {dict(options)!r}")


def load_policy_class(path: str, options: Mapping[str, Any] = {}) -> type:
    """The class a dotted path names ("package.module.Class" or "package.module:Class"), checked
    to implement `plan` and to accept `options` as keyword arguments."""
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"prefetch.policy {path!r}: expected 'package.module.Class' or 'package.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise ValueError(f"prefetch.policy {path!r}: module {module_name!r} does not import "
                         f"({type(e).__name__}: {e}); check the name and that it is on sys.path") from e
    cls = getattr(module, attr, None)
    if cls is None:
        raise ValueError(f"prefetch.policy {path!r}: module {module_name!r} has no attribute {attr!r}")
    if not isinstance(cls, type) or not callable(getattr(cls, "plan", None)):
        raise ValueError(f"prefetch.policy {path!r}: {attr} is not a class implementing tz.PrefetchPolicy "
                         "(a plan(view) method returning Fetch records)")
    try:
        inspect.signature(cls).bind(**options)
    except TypeError as e:
        raise ValueError(f"prefetch.options {dict(options)!r} do not fit {cls.__name__}{inspect.signature(cls)}: "
                         f"{e}") from e
    except ValueError:
        pass  # no signature to check (a builtin): the call at wrap reports
    return cls
