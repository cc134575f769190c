"""Phase events: the parts of a step (generate, score, update, optimizer_step, ...) announce themselves, and
whoever watches subscribes - the memory recorder for a training run, a benchmark's clock - so no step
function carries a `phase=` argument.

    with phase("generate"): ...                        # where the work is
    with watching(engine.recorder.phase): ...          # around the steps (the harness does this)

A watcher is a context-manager factory `watcher(name, **options)`; options a watcher does not use (the
recorder's `count_saved`) it ignores. Watchers nest in the order they subscribed. An error out of a phase says
which (`raised_in`): the innermost phase it left.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Callable, ContextManager, Iterator, Optional

Watcher = Callable[..., ContextManager]
_watchers: list[Watcher] = []
RAISED_IN = "_raised_in_phase"  # tagged on an error by the innermost phase it left (kept on the error, not here:
# a kept error would keep its frames' tensors alive past an out-of-memory retry)


@contextmanager
def phase(name: str, **options) -> Iterator[None]:
    """Run the body as phase `name` under every watcher (none: just the body)."""
    with errors_in(name), ExitStack() as stack:
        for watcher in list(_watchers):
            stack.enter_context(watcher(name, **options))
        yield


@contextmanager
def errors_in(name: str) -> Iterator[None]:
    """The errors out of the body rose in phase `name` (unless an inner phase said where): for work that belongs
    to a phase but runs before the watchers count it (a rollout's dense weight copy, made before generate's)."""
    try:
        yield
    except BaseException as exc:
        if not hasattr(exc, RAISED_IN):
            try:
                setattr(exc, RAISED_IN, name)
            except (AttributeError, TypeError):
                pass
        raise


def raised_in(exc: Optional[BaseException]) -> Optional[str]:
    """The phase `exc`, or the error it was raised from, rose in (the innermost one it left); None: no phase."""
    seen = set()
    while exc is not None and id(exc) not in seen:  # `raise a from b` after `raise b from a` makes a cycle
        if hasattr(exc, RAISED_IN):
            return getattr(exc, RAISED_IN)
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


@contextmanager
def watching(watcher: Watcher) -> Iterator[None]:
    """Subscribe `watcher` to the phases entered inside the body."""
    _watchers.append(watcher)
    try:
        yield
    finally:
        _watchers.remove(watcher)
