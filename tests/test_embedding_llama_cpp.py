"""llama.cpp's own server tests for embeddings (tools/server/tests/unit/test_embedding.py), the
cases that test the API rather than llama.cpp's model or flags, ported to the scripted encoder
(SmolLM2's tokenizer, 4-dimensional vectors): the bodies they send, what they assert.

Not ported: the pooling cases (``--pooling`` flags of llama.cpp), the exact token counts of
TinyLlama (ported as counts that add up), llama.cpp's object inputs (``{"prompt_string"}``,
``{"content": [...]}``) and prompts that mix strings and ids inside one prompt (refused here:
not in OpenAI's spec), and the too-long prompt (inputs are truncated here, as
sentence-transformers does)."""

from __future__ import annotations

import base64
import struct

import openai
import pytest

from turbospark.model.encoder import ScriptedEncoder

EPSILON = 1e-3
PATH = "/v1/embeddings"


@pytest.fixture
async def server(start_server):
    return await start_server(encoders=[ScriptedEncoder()])


async def test_embedding_single(server, client) -> None:
    res = await client.post(f"{server.url}{PATH}", json={"input": "I believe the meaning of life is"})
    assert res.status_code == 200
    assert len(res.json()["data"]) == 1
    assert "embedding" in res.json()["data"][0]
    assert len(res.json()["data"][0]["embedding"]) > 1
    # make sure embedding vector is normalized
    assert abs(sum(x ** 2 for x in res.json()["data"][0]["embedding"]) - 1) < EPSILON


async def test_embedding_multiple(server, client) -> None:
    res = await client.post(f"{server.url}{PATH}", json={"input": [
        "I believe the meaning of life is", "Write a joke about AI from a very long prompt which will not be truncated",
        "This is a test", "This is another test"]})
    assert res.status_code == 200
    assert len(res.json()["data"]) == 4
    for d in res.json()["data"]:
        assert "embedding" in d and len(d["embedding"]) > 1


@pytest.mark.parametrize(("input", "is_multi_prompt"), [
    ("", False),  # do not crash on empty input
    ("string", False),
    ([12, 34, 56], False),
    (["string1", "string2"], True),
    (["string1", [12, 34, 56]], True),
    ([[12, 34, 56], [12, 34, 56]], True),
])
async def test_embedding_mixed_input(server, client, input, is_multi_prompt) -> None:
    res = await client.post(f"{server.url}{PATH}", json={"input": input})
    assert res.status_code == 200
    data = res.json()["data"]
    if is_multi_prompt:
        assert len(data) == len(input)
        for d in data:
            assert "embedding" in d and len(d["embedding"]) > 1
    else:
        assert "embedding" in data[0] and len(data[0]["embedding"]) > 1


@pytest.mark.parametrize("input", [
    [],
    {"content": "string"},
    {"content": [{"type": "unknown"}]},
    {"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
    {"content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]},
    {"content": [{"type": "input_video", "input_video": {"url": "data:video/mp4;base64,AAAA"}}]},
    # llama.cpp's own extensions, outside OpenAI's spec: refused here
    [12, 34, "string", 56, 78],
    {"prompt_string": "string"},
])
async def test_embedding_invalid_input(server, client, input) -> None:
    res = await client.post(f"{server.url}{PATH}", json={"input": input})
    assert res.status_code == 400 and res.json()["error"]["type"] == "invalid_request_error"


async def test_embedding_openai_library_single(server) -> None:
    sdk = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="dummy")
    res = await sdk.embeddings.create(model="text-embedding-3-small", input="I believe the meaning of life is")
    assert len(res.data) == 1
    assert len(res.data[0].embedding) > 1


async def test_embedding_openai_library_multiple(server) -> None:
    sdk = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="dummy")
    res = await sdk.embeddings.create(model="text-embedding-3-small", input=[
        "I believe the meaning of life is", "Write a joke about AI", "This is a test", "This is another test"])
    assert len(res.data) == 4
    for d in res.data:
        assert len(d.embedding) > 1


async def test_embedding_openai_library_token_ids(server) -> None:
    """Beyond llama.cpp's cases: the SDK's own token-id forms, and ids give the text's vector."""
    from turbospark.model.scripted import shipped_tokenizer

    ids = shipped_tokenizer().encode("A cat sat.")
    sdk = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="dummy")
    text = await sdk.embeddings.create(model="m", input="A cat sat.")
    one = await sdk.embeddings.create(model="m", input=ids)
    many = await sdk.embeddings.create(model="m", input=[ids, ids[:2]])
    assert one.data[0].embedding == text.data[0].embedding == many.data[0].embedding
    assert one.usage.prompt_tokens == len(ids) and many.usage.prompt_tokens == len(ids) + 2


async def test_same_prompt_give_same_result(server, client) -> None:
    res = await client.post(f"{server.url}{PATH}", json={"input": ["I believe the meaning of life is"] * 5})
    assert res.status_code == 200
    assert len(res.json()["data"]) == 5
    v0 = res.json()["data"][0]["embedding"]
    for d in res.json()["data"][1:]:
        for x, y in zip(v0, d["embedding"], strict=True):
            assert abs(x - y) < EPSILON


@pytest.mark.parametrize("content", ["I believe the meaning of life is", "This is a test"])
async def test_embedding_usage_single(server, client, content) -> None:
    res = await client.post(f"{server.url}{PATH}", json={"input": content})
    assert res.status_code == 200
    assert res.json()["usage"]["prompt_tokens"] == res.json()["usage"]["total_tokens"]
    # TinyLlama's counts there (9, 6); here what the same tokenizer's /tokenize says
    ids = await client.post(f"{server.url}/tokenize", json={"content": content})
    assert res.json()["usage"]["prompt_tokens"] == len(ids.json()["tokens"])


async def test_embedding_usage_multiple(server, client) -> None:
    single = await client.post(f"{server.url}{PATH}", json={"input": "I believe the meaning of life is"})
    res = await client.post(f"{server.url}{PATH}", json={"input": ["I believe the meaning of life is"] * 2})
    assert res.status_code == 200
    assert res.json()["usage"]["prompt_tokens"] == res.json()["usage"]["total_tokens"]
    assert res.json()["usage"]["prompt_tokens"] == 2 * single.json()["usage"]["prompt_tokens"]


async def test_embedding_openai_library_base64(server, client) -> None:
    test_input = "Test base64 embedding output"
    res = await client.post(f"{server.url}{PATH}", json={"input": test_input})
    assert res.status_code == 200
    vec0 = res.json()["data"][0]["embedding"]
    res = await client.post(f"{server.url}{PATH}", json={"input": test_input, "encoding_format": "base64"})
    assert res.status_code == 200
    assert "data" in res.json() and len(res.json()["data"]) == 1
    embedding_data = res.json()["data"][0]
    assert isinstance(embedding_data["embedding"], str)
    decoded = base64.b64decode(embedding_data["embedding"])
    floats = struct.unpack(f"{len(decoded) // 4}f", decoded)
    assert len(floats) == len(vec0) > 0
    for x, y in zip(floats, vec0, strict=True):
        assert abs(x - y) < EPSILON
