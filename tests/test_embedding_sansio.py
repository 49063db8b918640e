"""The sans-io parts of embeddings: the batching pool, the checks and the encodings."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from turbospark.wire.embedding_checks import check_dimensions, check_inputs, encode_vector, inputs_of, shorten
from turbospark.errors import RequestInvalid
from turbospark.threads._embed_pool import EmbeddingPool, bucket_of
from turbospark.actors.registry import ModelEntry, Registry


def test_buckets_are_powers_of_two_from_16() -> None:
    assert [bucket_of(n) for n in (0, 1, 16, 17, 32, 33, 256, 257)] == [16, 16, 16, 32, 32, 64, 256, 512]


def test_pool_round_robins_over_jobs_within_the_first_inputs_bucket() -> None:
    pool = EmbeddingPool(max_batch=4)
    pool.add("a", [5, 5, 5, 5, 5])
    pool.add("b", [40, 6])
    pool.add("c", [7])
    assert len(pool) == 8 and pool.jobs == 3
    # rank 0: a0 (bucket 16), b0 (64: skipped), c0; rank 1: a1, b1 -> full
    assert pool.next_batch() == [("a", 0), ("c", 0), ("a", 1), ("b", 1)]
    assert pool.next_batch() == [("a", 2), ("a", 3), ("a", 4)]  # b0 waits for its own bucket
    assert pool.next_batch() == [("b", 0)]
    assert pool.next_batch() == [] and len(pool) == 0 and pool.jobs == 0


def test_pool_forgets_a_removed_job_and_skips_empty_ones() -> None:
    pool = EmbeddingPool(max_batch=8)
    pool.add("gone", [3, 3])
    pool.add("empty", [])
    pool.add("kept", [3])
    assert "empty" not in pool
    pool.remove("gone")
    pool.remove("never there")
    assert pool.next_batch() == [("kept", 0)]
    with pytest.raises(ValueError):
        EmbeddingPool(0)


def test_a_small_job_rides_in_the_next_batch_of_a_big_one() -> None:
    pool = EmbeddingPool(max_batch=64)
    pool.add("big", [10] * 2048)
    first = pool.next_batch()
    pool.add("small", [12])
    second = pool.next_batch()
    assert len(first) == 64 and {k for k, _ in first} == {"big"}
    assert second[1] == ("small", 0) and len(second) == 64


def test_input_checks_in_order() -> None:
    assert inputs_of("x") == ["x"] and inputs_of(["x", "y"]) == ["x", "y"]
    with pytest.raises(RequestInvalid, match="token ids"):
        inputs_of([1, 2])
    with pytest.raises(RequestInvalid, match="prompt must be a string"):
        inputs_of({"text": "x"}, "prompt")
    with pytest.raises(RequestInvalid, match="must not be empty"):
        check_inputs([])
    check_inputs([], allow_empty=True)
    check_inputs(["é" * (1 << 19)])  # exactly 1 MiB of UTF-8
    with pytest.raises(RequestInvalid, match="1048577 bytes"):
        check_inputs(["é" * (1 << 19), "x"])
    with pytest.raises(RequestInvalid, match="too many inputs: 2049"):
        check_inputs(["x" * 1000] * 2049)  # the count is checked before the size
    check_dimensions(None, 4)
    check_dimensions(4, 4)
    with pytest.raises(RequestInvalid, match="width of 4"):
        check_dimensions(5, 4)
    # short of the width only for a model trained for it (vLLM's rule)
    check_dimensions(2, 4, True, "m")
    check_dimensions(4, 4, False, "m")
    with pytest.raises(RequestInvalid, match="model 'm' does not support dimensions") as refused:
        check_dimensions(2, 4, False, "m")
    assert refused.value.param == "dimensions"
    check_dimensions(256, 768, (64, 128, 256, 512), "nomic")
    with pytest.raises(RequestInvalid, match=r"supports dimensions of 64, 128, 256, 512 \(or its own width of 768\), got 300"):
        check_dimensions(300, 768, (64, 128, 256, 512), "nomic")


def test_import_reads_whether_a_model_was_trained_for_truncation(tmp_path) -> None:
    from turbospark.store.encoder_import import embedding_spec

    base = {"hidden_size": 768, "max_position_embeddings": 512}
    assert "matryoshka" not in embedding_spec(tmp_path, base)
    assert embedding_spec(tmp_path, {**base, "matryoshka_dimensions": [768, 64, 256]})["matryoshka"] == [64, 256, 768]
    assert embedding_spec(tmp_path, {**base, "is_matryoshka": True})["matryoshka"] is True


def test_shorten_renormalises_and_encodings_agree() -> None:
    v = np.array([[0.6, 0.8, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]], dtype=np.float32)
    cut = shorten(v, 1)
    assert cut.tolist() == [[1.0], [1.0]]
    assert shorten(v, None) is v and shorten(v, 4) is v
    assert shorten(np.zeros((1, 3), np.float32), 2).tolist() == [[0.0, 0.0]]
    packed = encode_vector(v[0], "base64")
    assert np.frombuffer(base64.b64decode(packed), "<f4").tolist() == encode_vector(v[0], "float").tolist()


def test_resolution_counts_only_embedding_models() -> None:
    chat = ModelEntry("chat", 4096, frozenset({"chat", "completion"}), aliases=("claude-turbospark-chat",))
    small = ModelEntry("small", 256, frozenset({"embedding"}), dimensions=384)
    registry = Registry((chat, small))
    assert registry.resolve("text-embedding-3-small", "embedding") is small
    assert registry.resolve("chat", "embedding") is small  # a chat model is never an embedding model
    assert registry.resolve("small", "chat") is chat
