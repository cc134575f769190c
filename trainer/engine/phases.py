"""Phase events: the parts of a step (generate, score, update, optimizer_step, ...) announce themselves, and
whoever watches subscribes - the memory recorder for a training run, a benchmark's clock - so no step
function carries a `phase=` argument.

    with phase("generate"): ...                        # where the work is
    with watching(engine.recorder.phase): ...          # around the steps (the harness does this)

A watcher is a context-manager factory `watcher(name, **options)`; options a watcher does not use (the
recorder's `count_saved`) it ignores. Watchers nest in the order they subscribed.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Callable, ContextManager, Iterator

Watcher = Callable[..., ContextManager]
_watchers: list[Watcher] = []


@contextmanager
def phase(name: str, **options) -> Iterator[None]:
    """Run the body as phase `name` under every watcher (none: just the body)."""
    with ExitStack() as stack:
        for watcher in list(_watchers):
            stack.enter_context(watcher(name, **options))
        yield


@contextmanager
def watching(watcher: Watcher) -> Iterator[None]:
    """Subscribe `watcher` to the phases entered inside the body."""
    _watchers.append(watcher)
    try:
        yield
    finally:
        _watchers.remove(watcher)
