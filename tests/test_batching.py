"""idembus.storage.write_behind.Batcher: deferred writes, applied in batches from one thread."""

from __future__ import annotations

import threading

import pytest

from idembus.storage.write_behind import Batcher


class Sink:
    def __init__(self, fail_first: int = 0) -> None:
        self.batches: list[list[int]] = []
        self.fail_first = fail_first
        self.threads: set[str] = set()

    def write(self, batch: list[int]) -> None:
        self.threads.add(threading.current_thread().name)
        if self.fail_first:
            self.fail_first -= 1
            raise ConnectionError("database down")
        self.batches.append(batch)

    @property
    def items(self) -> list[int]:
        return [item for batch in self.batches for item in batch]


def test_items_added_from_many_threads_are_all_written_by_one_thread_in_batches():
    sink = Sink()
    batcher: Batcher[int] = Batcher(sink.write, name="marks", interval=0.01)
    adders = [threading.Thread(target=lambda n=n: [batcher.add(n * 1000 + i) for i in range(200)])
              for n in range(4)]
    for adder in adders:
        adder.start()
    for adder in adders:
        adder.join()

    batcher.flush()

    assert sorted(sink.items) == sorted(n * 1000 + i for n in range(4) for i in range(200))
    assert sink.threads == {"marks"}
    assert len(sink.batches) < 800  # batched, not one write per item
    batcher.close()


def test_a_full_batch_is_written_without_waiting_for_the_interval():
    sink = Sink()
    written = threading.Event()
    batcher: Batcher[int] = Batcher(lambda b: (sink.write(b), written.set()), name="m",
                                    interval=3600, size=3)
    for item in range(3):
        batcher.add(item)
    assert written.wait(10)
    assert sink.items == [0, 1, 2]
    batcher.close()


def test_close_writes_what_is_pending_and_refuses_more():
    sink = Sink()
    batcher: Batcher[int] = Batcher(sink.write, name="m", interval=3600)
    batcher.add(1)
    batcher.close()
    assert sink.items == [1]
    with pytest.raises(RuntimeError, match="closed"):
        batcher.add(2)
    batcher.close()  # idempotent


def test_a_failed_write_drops_its_batch_is_logged_and_later_batches_go_through(caplog):
    sink = Sink(fail_first=1)
    batcher: Batcher[int] = Batcher(sink.write, name="m", interval=0.01)
    batcher.add(1)
    batcher.flush()
    batcher.add(2)
    batcher.flush()
    assert sink.items == [2]
    assert "m dropped a batch of 1 after a failed write" in caplog.text
    batcher.close()


def test_flush_and_close_without_items_succeed_at_once_and_write_nothing():
    # Given a batcher that was never given an item (and would wait an hour to write)
    sink = Sink()
    batcher: Batcher[int] = Batcher(sink.write, name="idle-batcher", interval=3600)

    # Then flushing it is done at once (not "timed out" after waiting for the interval),
    # starts no writer thread, and closing it is done at once too; nothing is written, not
    # even an empty batch
    assert batcher.flush(timeout=5) is True
    assert "idle-batcher" not in {thread.name for thread in threading.enumerate()}
    assert batcher.close(timeout=5) is True
    assert sink.batches == []


def test_flush_does_not_wait_for_the_interval():
    sink = Sink()
    batcher: Batcher[int] = Batcher(sink.write, name="m", interval=3600)
    batcher.add(1)
    finished = threading.Event()
    threading.Thread(target=lambda: (batcher.flush(), finished.set()), daemon=True).start()
    assert finished.wait(10), "flush waited for the hour-long interval"
    assert sink.items == [1]
    batcher.close()
