"""Prompt-lookup drafts and the draft length (sans-io)."""

from __future__ import annotations

from turbospark.model.lookup import Backoff, Lookup, Pace


def test_the_draft_follows_the_longest_ngram_that_ends_the_text_at_its_last_occurrence() -> None:
    lk = Lookup([1, 2, 3, 9, 9, 2, 3, 7, 8, 5, 1, 2, 3])
    # "1 2 3" occurred at the start: what followed it then
    assert lk.draft(3) == [9, 9, 2]
    lk.extend([4, 2, 3])
    # "3 4 2 3" and "4 2 3" never occurred before; "2 3" last did at positions 11-12, then 4
    assert lk.draft(2) == [4, 2]


def test_no_draft_without_a_repeated_ngram_or_room() -> None:
    lk = Lookup([1, 2, 3, 4, 5])
    assert lk.draft(4) == []
    lk.extend([1, 2])
    assert lk.draft(0) == []
    assert lk.draft(10) == [3, 4, 5, 1, 2]  # it stops where the text does


def test_single_tokens_do_not_draft_by_default() -> None:
    assert Lookup([7, 1, 7]).draft(2) == []
    assert Lookup([7, 1, 7], min_n=1).draft(2) == [1, 7]


def test_pace_grows_on_full_acceptance_and_halves_on_none() -> None:
    pace = Pace(first=4, most=6)
    pace.record(4, 4)
    pace.record(5, 5)
    pace.record(6, 6)
    assert pace.k == 6
    pace.record(6, 2)
    assert pace.k == 6
    pace.record(6, 0)
    assert pace.k == 3
    pace.record(3, 0)
    pace.record(1, 0)
    assert pace.k == 1
    pace.record(0, 0)  # nothing drafted says nothing
    assert (pace.k, pace.drafted, pace.accepted) == (1, 31, 17)


def test_looks_for_drafts_wait_longer_after_each_that_kept_nothing() -> None:
    looks = Backoff(most=8)
    pattern = []
    for _ in range(30):
        if looks.due():
            pattern.append("L")
            looks.record(kept=False)
        else:
            pattern.append(".")
    # waits of 1, 2, 4, then 8 plain steps between looks
    assert "".join(pattern) == "L.L..L....L........L........L."
    looks.record(kept=True)
    assert looks.due() and looks.due()  # a look that kept a token: look every step again
    looks.record(kept=False)
    assert not looks.due() and looks.due()
    looks.record(kept=False)
    looks.reset()  # a new sequence
    assert looks.due()
