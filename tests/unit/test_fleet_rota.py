"""The ring of outboxes with work: turns, weights, joining and leaving."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from outbox_core.fleet.rota import Rota


def serve(rota: Rota, batches: int, *, drained: frozenset[str] = frozenset()) -> list[str]:
    """Who takes each of ``batches`` batches, the first in turn taking one each time."""
    served = []
    for _ in range(batches):
        passed: set[str] = set()
        while (label := rota.pick(passed)) is not None:
            passed.add(label)
            if label in drained:
                rota.drop(label)
                continue
            served.append(label)
            break
    return served


def test_outboxes_take_one_batch_each_in_turn() -> None:
    rota = Rota()
    for label in "abc":
        rota.add(label)
    assert serve(rota, 6) == ["a", "b", "c", "a", "b", "c"]


def test_a_weight_is_batches_in_a_row() -> None:
    rota = Rota()
    rota.add("big", 3)
    rota.add("small")
    assert serve(rota, 8) == ["big", "big", "big", "small", "big", "big", "big", "small"]


def test_an_outbox_with_fresh_work_waits_one_batch_behind_a_backlog() -> None:
    rota = Rota()
    rota.add("backlog")
    assert serve(rota, 5) == ["backlog"] * 5
    rota.add("fresh")
    assert serve(rota, 2) == ["backlog", "fresh"]


def test_adding_an_outbox_already_in_the_ring_changes_nothing() -> None:
    rota = Rota()
    assert rota.add("a")
    assert rota.add("b")
    assert not rota.add("a")
    assert rota.active() == ["a", "b"]


def test_claims_at_once_on_two_threads_keep_each_turn_its_weight() -> None:
    """Charged as picked: claims that overlap never start a second turn of one outbox."""
    import threading

    rota = Rota()
    rota.add("big", 3)
    rota.add("a")
    rota.add("b")
    served: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(2)

    def claim_loop() -> None:
        barrier.wait()
        for _ in range(50):
            label = rota.pick()
            assert label is not None
            with lock:
                served.append(label)

    threads = [threading.Thread(target=claim_loop) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert served.count("big") == 60 and served.count("a") == served.count("b") == 20


def test_a_drained_outbox_leaves_and_the_next_is_served() -> None:
    rota = Rota()
    for label in "abc":
        rota.add(label)
    assert serve(rota, 4, drained=frozenset("b")) == ["a", "c", "a", "c"]
    assert "b" not in rota


@given(
    weights=st.lists(st.integers(1, 4), min_size=1, max_size=6),
    rounds=st.integers(1, 5),
)
def test_every_outbox_gets_its_weight_per_round_and_none_starves(
    weights: list[int], rounds: int
) -> None:
    rota = Rota()
    labels = [f"o{i}" for i in range(len(weights))]
    for label, weight in zip(labels, weights, strict=True):
        rota.add(label, weight)
    served = serve(rota, sum(weights) * rounds)
    for label, weight in zip(labels, weights, strict=True):
        assert served.count(label) == weight * rounds
    # Between two turns of an outbox, every other outbox has its turn once.
    first = served.index(labels[-1])
    assert first < sum(weights)
