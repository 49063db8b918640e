"""Ollama's Modelfiles on the real default model (SmolLM2-135M-Instruct): a model made from a
Modelfile (``turbospark models create``) and through the official ``ollama`` client's
``create``, sharing the base's weights, chats with its system prompt and parameters as defaults,
and ``show`` prints its Modelfile back.  A base that is not in the store changes nothing."""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

import httpx
import ollama
import pytest
import trio

from turbospark.cli.attach import load_mlx
from turbospark.cli.models import main as models_main
from turbospark.config import Settings
from turbospark.model.tokenizer import Tokenizer
from turbospark.server import serve
from turbospark.store.shelf import StoreShelf
from turbospark.store.store import ModelStore

from .realmodels import smollm2_store

pytestmark = pytest.mark.mlx

BASE = "smollm2-135m-instruct"
SYSTEM = "You are a terse geography tutor. Answer in five words or fewer."
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MODELFILE = f'''FROM {BASE}
SYSTEM """{SYSTEM}"""
PARAMETER temperature 0
PARAMETER top_k 1
LICENSE """Apache-2.0 (SmolLM2)"""
'''


@pytest.fixture
def store(tmp_path: Path) -> ModelStore:
    """A store of its own holding SmolLM2, its files hard-linked from the test cache."""
    cached = smollm2_store()
    store = ModelStore(tmp_path / "models")
    (store.root / BASE).mkdir(parents=True)
    for f in cached.path.iterdir():
        os.link(f, store.root / BASE / f.name)
    return store


@pytest.fixture
async def client(nursery: trio.Nursery, store: ModelStore):
    shelf = StoreShelf(store, load_mlx)
    server = await nursery.start(partial(
        serve, Settings(host="127.0.0.1", port=0, graceful_timeout=1.0), [], library=shelf.loadables, shelf=shelf,
    ))
    yield ollama.AsyncClient(host=server.url, timeout=120)
    server.stop.set()


def test_models_create_makes_a_model_that_shares_the_weights(store, tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "Modelfile").write_text(MODELFILE)
    monkeypatch.setenv("TURBOSPARK_HOME", str(tmp_path))
    assert models_main(["create", "tutor", "-f", str(tmp_path / "Modelfile")]) == 0
    assert "created tutor" in capsys.readouterr().out
    made = store.get("tutor")
    assert made is not None and made.manifest["parent_model"] == BASE
    weights = store.root / BASE / "model.safetensors"
    assert (made.path / "model.safetensors").stat().st_ino == weights.stat().st_ino  # no copy
    (tmp_path / "Bad").write_text("FROM nowhere-to-be-found\n")
    before = sorted(m.name for m in store.list())
    assert models_main(["create", "lost", "-f", str(tmp_path / "Bad")]) == 1
    assert "nowhere-to-be-found" in capsys.readouterr().err
    assert sorted(m.name for m in store.list()) == before


async def test_a_created_model_chats_with_its_system_prompt_and_parameters(client, store) -> None:
    statuses = [p.status async for p in await client.create(
        model="tutor", from_=BASE, system=SYSTEM, parameters={"temperature": 0, "top_k": 1}, stream=True,
    )]
    assert statuses[0] == "gathering model components" and statuses[-1] == "success"
    assert "tutor" in [m.model for m in (await client.list()).models]

    r = await client.chat(model="tutor", messages=QUESTION)
    tokenizer = Tokenizer.from_dir(store.get(BASE).path)
    with_system = [{"role": "system", "content": SYSTEM}, *QUESTION]
    assert r.prompt_eval_count == len(tokenizer.encode_chat(with_system))  # its system prompt, not the base's
    # the same as the base told that system prompt and greedy decoding by hand
    by_hand = await client.chat(model=BASE, messages=with_system, options={"temperature": 0})
    assert r.message.content == by_hand.message.content and r.message.content
    # a request's own system message still wins
    own = await client.chat(model="tutor", messages=[{"role": "system", "content": "Be kind."}, *QUESTION])
    assert own.prompt_eval_count == len(tokenizer.encode_chat([{"role": "system", "content": "Be kind."}, *QUESTION]))

    shown = await client.show("tutor")
    assert f"\nFROM {BASE}\n" in shown.modelfile and f'SYSTEM {SYSTEM}' in shown.modelfile
    assert "PARAMETER temperature 0" in shown.modelfile
    assert "temperature" in shown.parameters and shown.details.parent_model == BASE


async def test_messages_open_every_conversation(client, store) -> None:
    opening = [{"role": "user", "content": "Remember: my name is Ada."}, {"role": "assistant", "content": "Hello Ada."}]
    done = await client.create(model="ada", from_=BASE, messages=opening, license="MIT")
    assert done.status == "success"
    r = await client.chat(model="ada", messages=QUESTION, options={"num_predict": 1})
    tokenizer = Tokenizer.from_dir(store.get(BASE).path)
    assert r.prompt_eval_count == len(tokenizer.encode_chat([*opening, *QUESTION]))
    shown = await client.show("ada")
    assert "MESSAGE user Remember: my name is Ada." in shown.modelfile and shown.license == "MIT"


async def test_a_base_not_in_the_store_is_a_404_and_changes_nothing(client, store) -> None:
    before = sorted(m.model for m in (await client.list()).models)
    with pytest.raises(ollama.ResponseError) as caught:
        await client.create(model="ghost", from_="no-such-base", system="Boo")
    assert caught.value.status_code == 404 and "no-such-base" in caught.value.error
    with pytest.raises(ollama.ResponseError) as caught:  # an adapter never uploaded
        await client.create(model="ghost", from_=BASE, adapters={"lora.gguf": "sha256:" + "0" * 64})
    assert caught.value.status_code == 400 and "was never uploaded" in caught.value.error
    # a path on the server's machine is never read for a request: the adapter's files are uploaded
    raw = await httpx.AsyncClient().post(f"{client._client.base_url}/api/create", json={
        "model": "ghost", "modelfile": f"FROM {BASE}\nADAPTER /etc/passwd", "stream": False})
    assert raw.status_code == 400 and "upload the adapter" in raw.json()["error"]
    assert sorted(m.model for m in (await client.list()).models) == before
    assert sorted(p.name for p in store.root.iterdir() if not p.name.startswith(".")) == [BASE]


async def test_a_created_model_carries_its_adapter_to_every_request(client, store, tmp_path, monkeypatch,
                                                                    capsys) -> None:
    """Ollama's ``ADAPTER``: ``ollama create`` uploads the adapter's files and names them in
    ``adapters``; the model made answers as mlx-lm answers with that adapter loaded
    (decision 0046).  ``models import ADAPTER --base`` stores the same."""
    from mlx_lm.utils import load_model

    from .test_mlx_lora import PROMPT, _adapter, _greedy

    folder = _adapter(load_model(smollm2_store().path)[0], tmp_path / "pirate", size=0.04)
    digests = {name: await client.create_blob(folder / name) for name in ("adapter_config.json", "adapters.safetensors")}
    done = await client.create(model="pirate", from_=BASE, adapters=digests)
    assert done.status == "success"
    assert (store.get("pirate").path / "adapter" / "adapters.safetensors").is_file()
    options = {"num_predict": 10, "temperature": 0}
    r = await client.generate(model="pirate", prompt=PROMPT, raw=True, options=options)
    base = await client.generate(model=BASE, prompt=PROMPT, raw=True, options=options)
    assert r.response == _greedy(folder, 10) != base.response
    assert "\nADAPTER adapters.safetensors" not in (await client.show("pirate")).modelfile  # the folder's name
    assert "\nADAPTER " in (await client.show("pirate")).modelfile
    # the same adapter as a GGUF LoRA, uploaded as a blob (no .gguf name: read by its magic)
    from .test_mlx_lora import gguf_lora

    config = json.loads((smollm2_store().path / "config.json").read_text())
    lora = gguf_lora(folder, tmp_path / "pirate.gguf", (config["num_attention_heads"], config["num_key_value_heads"]))
    done = await client.create(model="pirate-gguf", from_=BASE, adapters={"lora.gguf": await client.create_blob(lora)})
    assert done.status == "success"
    r = await client.generate(model="pirate-gguf", prompt=PROMPT, raw=True, options=options)
    assert r.response == _greedy(folder, 10)
    monkeypatch.setenv("TURBOSPARK_HOME", str(tmp_path))
    assert models_main(["import", str(folder), "--base", BASE, "--name", "pirate2"]) == 0
    assert "imported pirate2" in capsys.readouterr().out
    assert (store.get("pirate2").path / "adapter" / "adapter_config.json").is_file()
    assert models_main(["import", str(tmp_path), "--base", BASE, "--name", "nothing"]) == 1
    assert "neither an mlx-lm adapter directory" in capsys.readouterr().err
