"""Running a test's requests at once, each in its own thread."""

from __future__ import annotations

import threading


def in_threads(fn, items, *, timeout: float = 120) -> list:
    """fn(item) for every item, each in its own thread, the calls released together by a
    barrier (each thread joined for up to `timeout` seconds); results in order. Any exception
    fails the test, all of them listed."""
    results: list = [None] * len(items)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(items))

    def run(i: int) -> None:
        try:
            barrier.wait(timeout)
            results[i] = fn(items[i])
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors, errors
    return results
