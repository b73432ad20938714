"""Progress reporting. Long loops call `track` or `bar`; a rich bar is drawn on stderr.

Set LLMCOMPRESS_PROGRESS=0 to silence bars (the tests do, to keep logs short).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


def enabled() -> bool:
    return os.environ.get("LLMCOMPRESS_PROGRESS", "1") != "0"


def _progress():
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
        console=Console(stderr=True),
        transient=False,
    )


def track(items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    """Iterate with a progress bar (or silently when progress is disabled)."""
    if not enabled():
        yield from items
        return
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with _progress() as p:
        task = p.add_task(description, total=total, info="")
        for item in items:
            yield item
            p.advance(task)


class _Bar:
    def __init__(self, progress, task) -> None:
        self._p, self._t = progress, task

    def advance(self, n: float = 1, info: str | None = None) -> None:
        if self._p is not None:
            if info is not None:
                self._p.update(self._t, info=info)
            self._p.advance(self._t, n)

    def update(self, completed: float | None = None, info: str | None = None) -> None:
        if self._p is not None:
            kw = {}
            if completed is not None:
                kw["completed"] = completed
            if info is not None:
                kw["info"] = info
            self._p.update(self._t, **kw)


@contextmanager
def bar(description: str, total: float | None):
    """A manually advanced bar: `with bar("search", total=G) as b: b.advance(info="kl=0.3")`."""
    if not enabled():
        yield _Bar(None, None)
        return
    with _progress() as p:
        yield _Bar(p, p.add_task(description, total=total, info=""))
