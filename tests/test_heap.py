"""The API's calls run without CPython's full collections (autoplan.api.heap), and leave the collector as it was."""

import gc

import pytest

from autoplan.api.heap import young_collections_only
from autoplan.api.search import search  # imported here: `autoplan.search` imports it outside the call
from autoplan.errors import UsageError


@pytest.fixture
def collections():
    """(generation, gc's thresholds then) of each collection while the test runs, in order."""
    seen: list[tuple[int, tuple]] = []

    def record(phase, info):
        if phase == "start":
            seen.append((info["generation"], gc.get_threshold()))

    gc.callbacks.append(record)
    yield seen
    gc.callbacks.remove(record)


def _as_many_objects_again() -> list:
    """As many new long-lived objects as the collector tracks: more than a quarter more, many collections' worth."""
    return [[] for _ in range(len(gc.get_objects()))]


def test_long_lived_objects_made_inside_start_no_full_collection(collections):
    gc.collect()
    collections.clear()
    kept = _as_many_objects_again()
    assert 2 in [generation for generation, _ in collections]  # outside: the oldest generation is collected
    del kept
    gc.collect()
    collections.clear()
    with young_collections_only():
        kept = _as_many_objects_again()
    generations = [generation for generation, _ in collections]
    assert 1 in generations and 2 not in generations
    del kept  # alive until here: the objects the collections above saw


def test_a_search_runs_paused_and_restores_the_thresholds(collections):
    before = gc.get_threshold()
    search("gpt2-tiny", "300MB", gpus=2, seq_len=64, fit_to="allocated")
    assert gc.get_threshold() == before
    assert collections and all(thresholds[2] > before[2] for _, thresholds in collections)


def test_the_pause_is_restored_after_an_error_and_left_to_an_outer_one():
    before = gc.get_threshold()
    with pytest.raises(UsageError):
        search("no-such-model", "300MB", gpus=2)
    assert gc.get_threshold() == before
    with young_collections_only():
        paused = gc.get_threshold()
        assert paused[:2] == before[:2] and paused[2] > before[2]
        with young_collections_only():
            assert gc.get_threshold() == paused
        assert gc.get_threshold() == paused  # the inner one leaves it to the outer
    assert gc.get_threshold() == before


def test_an_explicit_collection_still_runs_inside(collections):
    with young_collections_only():
        collections.clear()
        gc.collect()
    assert [generation for generation, _ in collections] == [2]
