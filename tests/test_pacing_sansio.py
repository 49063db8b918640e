"""The join pacer: a newcomer's prefill chunk steered by what it costs the streams decoding."""

from __future__ import annotations

from turbospark.model.pacing import JoinPacer


def test_nothing_decoding_means_the_whole_chunk() -> None:
    pacer = JoinPacer(128)
    assert pacer.size(decoding=0) == 128
    assert pacer.size(decoding=3) == 128  # no decode step measured yet: nothing to steer by
    pacer.record(0.1, decoding=3, prefilled=0)
    assert pacer.size(decoding=0) == 128
    assert pacer.size(decoding=3) == 8  # from its least: the first mixed steps grow it if they may


def test_the_chunk_shrinks_while_mixed_steps_stall_and_grows_while_they_do_not() -> None:
    pacer = JoinPacer(128)
    for _ in range(5):
        pacer.record(0.1, decoding=4, prefilled=0)
    pacer.record(0.11, decoding=4, prefilled=1)  # cheap: it grows
    chunk = pacer.size(4)
    assert chunk > 8
    pacer.record(0.5, decoding=4, prefilled=1)  # 5x the usual gap
    assert pacer.size(4) < chunk
    for _ in range(20):
        pacer.record(0.5, decoding=4, prefilled=1)
    assert pacer.size(4) == 8  # never below its least
    for _ in range(40):
        pacer.record(0.11, decoding=4, prefilled=1)  # cheap: it may grow, up to the most
    assert pacer.size(4) == 128
    size = pacer.size(4)
    pacer.record(0.14, decoding=4, prefilled=1)  # between 1.2x and 1.5x: left as it is
    assert pacer.size(4) == size


def test_the_usual_gap_is_the_median_of_decode_only_steps() -> None:
    pacer = JoinPacer(64)
    for s in (0.1, 0.1, 0.9, 0.1, 0.2):
        pacer.record(s, decoding=1, prefilled=0)
    pacer.record(5.0, decoding=0, prefilled=2)  # nobody waited: says nothing
    assert pacer.gap == 0.1
