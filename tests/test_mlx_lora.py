"""LoRA and DoRA adapters served per request (``serve --lora``, decision 0046): made with mlx-lm's
own LoRA layers, each request's greedy text is what ``mlx_lm``'s ``load_adapters`` gives on the
same float32 weights, whether its batch holds other adapters' rows or the base model's; chosen by
the model's name (vLLM's convention) or llama.cpp's ``lora`` field; the prefix cache keyed by
adapter; a GGUF LoRA read as llama.cpp writes it; one for another model refused clearly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from turbospark.config import Settings
from turbospark.model.mlx_adapters import AdapterError
from turbospark.store.adapter_files import read_adapter, read_adapters
from turbospark.model.backend import BackendSpec, SamplingParams
from turbospark.server import serve
from turbospark.turns.sampling import adapters_chosen
from turbospark.wire.openai import LoraChoice

from .realmodels import smollm2_store

PROMPT = "The capital of France is"


def _adapter(model: Any, folder: Path, *, dora: bool = False, keys: list[str] | None = None, layers: int = 8,
             seed: int = 5, size: float = 0.02) -> Path:
    """``model``'s adapter as ``mlx_lm.lora`` writes one, its ``lora_b`` random (it starts at 0)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    params = {"rank": 8, "scale": 20.0, "dropout": 0.0, **({"keys": keys} if keys else {})}
    model.freeze()
    linear_to_lora_layers(model, layers, params, use_dora=dora)
    mx.random.seed(seed)
    model.load_weights([(n, size * mx.random.normal(p.shape)) for n, p in tree_flatten(model.trainable_parameters())
                        if n.endswith("lora_b")], strict=False)
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    config = {"fine_tune_type": "dora" if dora else "lora", "num_layers": layers, "lora_parameters": params}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def _tiny(seed: int = 0) -> Any:
    import mlx.core as mx
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=100,
                           tie_word_embeddings=False)
    mx.random.seed(seed)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("kernels", [False, True], ids=["mlx", "kernels"])
def test_rows_of_one_batch_each_get_their_adapter_as_mlx_lm_applies_it(tmp_path, kernels, fast_ops_restored) -> None:
    import mlx.core as mx
    from mlx_lm.tuner.utils import load_adapters

    from turbospark.model import mlx_kernels
    from turbospark.model.mlx_adapters import attach

    folders = [_adapter(_tiny(), tmp_path / "lora", keys=["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"],
                        layers=3, size=0.1),
               _adapter(_tiny(), tmp_path / "dora", dora=True, layers=2, seed=6, size=0.1)]
    x = mx.array([[1, 2, 3, 4, 5], [7, 8, 9, 10, 11], [3, 5, 7, 9, 11], [2, 4, 6, 8, 10]])
    wanted = [_tiny()(x)]
    for folder in folders:
        ref = _tiny()
        load_adapters(ref, str(folder))
        wanted.append(ref(x))
    ours = _tiny()
    if kernels:
        line = mlx_kernels.install(ours)
        if "4 of 4 decoder layers fused" not in line:
            pytest.skip(f"the kernels do not fuse here: {line}")
    route = attach(ours, [read_adapter("lora", folders[0]), read_adapter("dora", folders[1])])
    assert route is not None
    route.use(10, [(0, 1.0)])  # engine ids 10-13: lora, none, dora, lora at half its scale
    route.use(12, [(1, 1.0)])
    route.use(13, [(0, 0.5)])
    with route.rows([10, 11, 12, 13]):
        got = ours(x)
    tolerance = 1e-5  # float32 sums in another order
    assert mx.abs(got[0] - wanted[1][0]).max().item() <= tolerance
    assert mx.abs(got[1] - wanted[0][1]).max().item() <= tolerance
    assert mx.abs(got[2] - wanted[2][2]).max().item() <= tolerance
    assert mx.abs(wanted[1][0] - wanted[0][0]).max().item() > 0.1  # each adapter changes its row
    assert mx.abs(wanted[2][2] - wanted[0][2]).max().item() > 0.1
    half = got[3] - wanted[0][3]
    assert 0 < mx.abs(half).max().item() < mx.abs(wanted[1][3] - wanted[0][3]).max().item()
    assert mx.abs(ours(x) - wanted[0]).max().item() <= tolerance  # rows outside a route: the base


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:  # llama.cpp's converter's Q/K row order
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def gguf_lora(folder: Path, target: Path, heads: tuple[int, int]) -> Path:
    """The mlx-lm adapter at ``folder`` (scale 20, rank 8) as llama.cpp's ``convert_lora_to_gguf.py``
    writes a LoRA: PEFT's lora_A and lora_B, Q and K rows in its RoPE order, alpha = scale * rank."""
    import gguf

    adapter = read_adapter("a", folder)
    writer = gguf.GGUFWriter(str(target), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", 20.0 * 8)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for path, (a, b, _) in adapter.layers.items():
        layer, module = path.split(".")[2], path.split(".", 3)[3]
        peft_b = (b / 20.0).T
        if module in ("self_attn.q_proj", "self_attn.k_proj"):
            peft_b = _permute(peft_b, heads[0] if module == "self_attn.q_proj" else heads[1])
        writer.add_tensor(f"blk.{layer}.{names[module]}.weight.lora_a", np.ascontiguousarray(a.T))
        writer.add_tensor(f"blk.{layer}.{names[module]}.weight.lora_b", np.ascontiguousarray(peft_b))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def test_a_gguf_lora_reads_as_the_mlx_adapter_it_was_written_from(tmp_path) -> None:
    """llama.cpp's layout (PEFT's lora_A and lora_B, Q and K rows in its RoPE order, the scale
    as alpha / rank) reads back as the mlx-lm adapter."""
    from turbospark.store.gguf_tensors import unpermute

    folder = _adapter(_tiny(), tmp_path / "lora", layers=2, size=0.1)
    mlx = read_adapter("a", folder)
    read = read_adapter("g", gguf_lora(folder, tmp_path / "lora.gguf", (4, 2)), heads=(4, 2))
    assert sorted(read.layers) == sorted(mlx.layers)
    for path, (a, b, _) in mlx.layers.items():
        assert np.allclose(read.layers[path][0], a) and np.allclose(read.layers[path][1], b, atol=1e-6), path
    assert unpermute(_permute(np.arange(16.0)[:, None], 2), 2)[:, 0].tolist() == list(range(16))


def test_an_adapter_of_another_model_is_refused_saying_why(tmp_path) -> None:
    from turbospark.model.mlx_adapters import attach

    other = _tiny()
    other.model.layers[0].self_attn.q_proj = __import__("mlx.nn", fromlist=["nn"]).Linear(64, 32, bias=False)
    folder = _adapter(other, tmp_path / "other", keys=["self_attn.q_proj"], layers=4)
    with pytest.raises(AdapterError, match=r"adapter other: model\.layers\.0\.self_attn\.q_proj is 64 -> 64 in this "
                                           r"model, 64 -> 32 in the adapter"):
        attach(_tiny(), [read_adapter("other", folder)])
    wide = _tiny()
    wide.model.layers[0].self_attn.q_proj = __import__("mlx.nn", fromlist=["nn"]).Linear(48, 64, bias=False)
    narrow = _adapter(wide, tmp_path / "narrow", keys=["self_attn.q_proj"], layers=4)
    with pytest.raises(AdapterError, match=r"model\.layers\.0\.self_attn\.q_proj does not take 48 inputs"):
        attach(_tiny(), [read_adapter("narrow", narrow)])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "full"}))
    (tmp_path / "full" / "adapters.safetensors").write_bytes(b"")
    with pytest.raises(AdapterError, match="cannot read|a model of its own"):
        read_adapter("full", tmp_path / "full")
    with pytest.raises(AdapterError, match="neither an mlx-lm adapter directory"):
        read_adapter("none", tmp_path / "missing")


def test_a_request_chooses_by_the_model_name_or_llama_cpp_s_lora_field() -> None:
    base = SamplingParams()
    names = ("pirate", "legal")
    assert adapters_chosen(base, names, "smollm2").adapters == ()
    assert adapters_chosen(base, names, "legal").adapters == ((1, 1.0),)
    assert adapters_chosen(base, names, "pirate:latest").adapters == ((0, 1.0),)  # Ollama's tag
    lora = [LoraChoice(id=1, scale=0.5), LoraChoice(id=0)]
    assert adapters_chosen(base, names, "pirate", lora).adapters == ((1, 0.5), (0, 1.0))  # the field decides
    assert adapters_chosen(base, names, "pirate", []).adapters == ((0, 1.0),)  # an empty one says nothing


# --- served --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    from mlx_lm.utils import load_model

    stored = smollm2_store()
    root = tmp_path_factory.mktemp("adapters")
    return {"smol-pirate": _adapter(load_model(stored.path)[0], root / "pirate", size=0.04),
            "smol-dora": _adapter(load_model(stored.path)[0], root / "dora", dora=True, seed=6, size=0.05)}


def _greedy(adapter: Path | None, n: int) -> str:
    """What mlx-lm's own generation gives, greedy, with ``load_adapters``."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    model, tokenizer = load(str(smollm2_store().path), adapter_path=str(adapter) if adapter else None)
    steps = generate_step(mx.array(tokenizer.encode(PROMPT)), model, max_tokens=n)
    return tokenizer.decode([int(token) for token, _ in steps])


@pytest.mark.mlx
async def test_requests_with_and_without_adapters_share_the_batch_each_with_mlx_lm_s_text(
        nursery, client, adapters) -> None:
    from turbospark.model.mlx_backend import MlxBackend

    stored = smollm2_store()
    make = lambda: MlxBackend(stored.path, model_id=stored.name,  # noqa: E731
                              adapters=read_adapters(stored.path, list(adapters.items())))
    settings = Settings(host="127.0.0.1", port=0, graceful_timeout=1.0, max_batch=8)
    server = await nursery.start(serve, settings, [BackendSpec(stored.name, make)])
    wanted = {name: _greedy(adapters.get(name), 10) for name in (stored.name, *adapters)}
    assert len(set(wanted.values())) == 3, wanted  # each adapter says something else

    async def complete(model: str, **extra: Any) -> dict[str, Any]:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, **extra}
        r = await client.post(server.url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    got: dict[int, str] = {}
    order = [stored.name, "smol-pirate", stored.name, "smol-dora", "smol-pirate", stored.name]

    async def one(i: int, model: str) -> None:
        got[i] = (await complete(model))["choices"][0]["text"]

    async with trio.open_nursery() as nursery:  # all at once: one batch, base and adapted rows
        for i, model in enumerate(order):
            nursery.start_soon(one, i, model)
    assert [got[i] for i in range(len(order))] == [wanted[m] for m in order]
    # llama.cpp's field: by index, whatever the model's name
    assert (await complete(stored.name, lora=[{"id": 0, "scale": 1.0}]))["choices"][0]["text"] == wanted["smol-pirate"]
    # the prefix cache is keyed by adapter: the base model's KV of this prompt is not the adapter's
    story = "Once upon a time, in a village by the sea,"
    first = await complete("smol-pirate", prompt=story)
    again = await complete("smol-pirate", prompt=story)
    base = await complete(stored.name, prompt=story)
    other = await complete("smol-dora", prompt=story)  # the base's and the LoRA's KV are not its
    cached = [r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) for r in (first, again, base, other)]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0 and cached[3] == 0, cached
    bad = await client.post(server.url + "/v1/completions", json={"model": stored.name, "prompt": PROMPT,
                                                                   "lora": [{"id": 2}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora"
    assert "0-1 (smol-pirate, smol-dora)" in bad.json()["error"]["message"]
    dora = await client.post(server.url + "/v1/completions", json={"model": "smol-dora", "prompt": PROMPT,
                                                                    "lora": [{"id": 1, "scale": 0.5}]})
    assert dora.status_code == 400 and "DoRA" in dora.json()["error"]["message"]
    listed = {m["id"] for m in (await client.get(server.url + "/v1/models")).json()["data"]}
    assert {stored.name, "smol-pirate", "smol-dora"} <= listed
    tags = [m["name"] for m in (await client.get(server.url + "/api/tags")).json()["models"]]
    assert tags == [stored.name, "smol-pirate", "smol-dora"]
    ollama = await client.post(server.url + "/api/generate", json={
        "model": "smol-pirate", "prompt": PROMPT, "raw": True, "stream": False,
        "options": {"num_predict": 10, "temperature": 0}})
    assert ollama.json()["response"] == wanted["smol-pirate"]
    server.stop.set()
