"""A rich progress bar around an iterable, drawn only when asked (imported lazily)."""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")


def track(items: Iterable[T], show: bool, total: int, label: str = "working",
          weight: Callable[[T], int] = lambda _: 1) -> Iterator[T]:
    """Yield ``items``; with ``show``, draw a bar (done / ``total``) on stderr, ``weight`` per item.

    Example:
        >>> list(track([1, 2, 3], show=False, total=3))
        [1, 2, 3]
    """
    if not show:
        yield from items
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
    with Progress(label, BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=total)
        for item in items:
            yield item
            bar.advance(task, weight(item))
