"""``idembus run`` tunes the garbage collector before it consumes (``--no-gc-tuning``: not):
what start-up made is frozen, and the youngest generation collected less often."""

from __future__ import annotations

import gc
import sys
import types
from collections.abc import Iterator

import pytest

from idembus import Endpoint
from idembus.cli.commands import main
from idembus.cli.worker import YOUNGEST_THRESHOLD


class RecordingEndpoint(Endpoint):
    """An endpoint whose ``run`` notes the collector's state as it starts to consume, and
    returns at once as after a clean stop."""

    frozen_at_run: int | None = None
    collected_at_run: bool | None = None
    threshold_at_run: tuple[int, ...] | None = None

    def run(self, shutdown_timeout: float | None = None) -> bool:  # type: ignore[override]
        self.frozen_at_run = gc.get_freeze_count()
        # gc.get_objects() lists the generations the collector walks, not the frozen
        self.collected_at_run = any(found is self for found in gc.get_objects())
        self.threshold_at_run = gc.get_threshold()
        return True


@pytest.fixture
def endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[RecordingEndpoint]:
    built = RecordingEndpoint("gc-tuning")
    module = types.ModuleType("gc_tuning_app")
    module.endpoint = built  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "gc_tuning_app", module)
    threshold = gc.get_threshold()
    gc.unfreeze()
    yield built
    gc.unfreeze()  # the rest of the test run's objects stay collectable
    gc.set_threshold(*threshold)
    built.close()


def test_idembus_run_freezes_what_start_up_made_and_collects_the_young_less_often(
        endpoint: RecordingEndpoint) -> None:
    gc.set_threshold(700, 10, 10)  # Python's own

    assert main(["run", "gc_tuning_app:endpoint"]) == 0

    # The endpoint itself, its module and everything imported are out of the collector's
    # reach by the time it consumes; the older generations' thresholds are Python's
    assert endpoint.frozen_at_run is not None and endpoint.frozen_at_run > 1000
    assert endpoint.collected_at_run is False
    assert endpoint.threshold_at_run == (YOUNGEST_THRESHOLD, 10, 10)


@pytest.mark.parametrize("threshold", [(0, 10, 10), (20_000, 5, 5)])
def test_a_collector_turned_off_or_set_higher_is_left_as_it_was(
        endpoint: RecordingEndpoint, threshold: tuple[int, int, int]) -> None:
    gc.set_threshold(*threshold)

    assert main(["run", "gc_tuning_app:endpoint"]) == 0

    assert endpoint.threshold_at_run == threshold


def test_with_no_gc_tuning_nothing_is_frozen_or_changed(endpoint: RecordingEndpoint) -> None:
    gc.set_threshold(700, 10, 10)

    assert main(["run", "gc_tuning_app:endpoint", "--no-gc-tuning"]) == 0

    assert endpoint.frozen_at_run == 0 and endpoint.collected_at_run is True
    assert endpoint.threshold_at_run == (700, 10, 10)
