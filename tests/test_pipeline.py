"""Pipeline (layer) sharding (``model/pipeline.py``): how the layers split; every architecture
the store imports gives one process's logits from its slices, on 2 ranks and on 3 (a middle
rank receives and sends); the default model, whose heads do not divide by 2, is split by layers
over 2 ranks without being asked and answers with one process's greedy text."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import attrs
import httpx
import pytest

from turbospark.cli.attach import ModelSetupError
from turbospark.cli.distributed import shard_mode
from turbospark.model.pipeline import split
from turbospark.store.gguf_import import convert_gguf

from .model.gguf_tiny_models import CASES, write_tiny
from .test_distributed import LAUNCH, NO_EXTRAS, Running, _answers, _metric, _port

ROOT = Path(__file__).resolve().parents[1]
needs_launch = pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")

#: one tiny model per architecture the store imports, with enough layers for 3 ranks
ARCHITECTURES = {
    name: attrs.evolve(CASES[name], vocab="bytes", layers=max(CASES[name].layers, 3))
    for name in ("llama3", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
}


def test_the_layers_split_in_contiguous_slices_in_rank_order() -> None:
    assert split(30, 2) == [(0, 15), (15, 30)]  # SmolLM2-135M
    assert split(3, 2) == [(0, 1), (1, 3)]  # the extra layer goes to the later rank (rank 0 serves HTTP)
    assert split(7, 3) == [(0, 2), (2, 4), (4, 7)]
    assert split(3, 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="2 layers, fewer than the 3 ranks"):
        split(2, 3)


def test_the_split_is_chosen_from_the_config_before_anything_loads(tmp_path: Path) -> None:
    def mode(asked: str | None, model_type: str, heads: int, kv: int, layers: int, ranks: int = 2) -> str:
        (tmp_path / "config.json").write_text(json.dumps({
            "model_type": model_type, "num_attention_heads": heads, "num_key_value_heads": kv,
            "num_hidden_layers": layers}))
        return shard_mode(tmp_path, ranks, asked)

    assert mode(None, "llama", 4, 2, 3) == "tensor"  # heads that divide, an architecture with shard()
    assert mode(None, "llama", 9, 3, 30) == "pipeline"  # SmolLM2-135M
    assert mode(None, "gemma3_text", 4, 2, 18) == "pipeline"  # mlx-lm cannot shard Gemma 3 by tensors
    assert mode("pipeline", "llama", 4, 2, 3) == "pipeline"
    with pytest.raises(ModelSetupError, match="do not split evenly over 2 ranks.*--shard pipeline can"):
        mode("tensor", "llama", 9, 3, 30)
    with pytest.raises(ModelSetupError, match="gemma3_text model, which mlx-lm cannot shard by tensors"):
        mode("tensor", "gemma3_text", 4, 2, 18)
    with pytest.raises(ModelSetupError, match="has 2 layers, fewer than the 3 ranks"):
        mode(None, "llama", 4, 2, 2, ranks=3)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("architectures")
    out = []
    for name, model in ARCHITECTURES.items():
        write_tiny(model, root / f"{name}.gguf", root)  # the "bytes" vocabulary is built in
        (root / name).mkdir()
        convert_gguf(root / f"{name}.gguf", root / name, dtype="float32", progress=False)
        out.append(root / name)
    return out


@needs_launch
@pytest.mark.parametrize("ranks", [2, 3])
def test_every_architecture_gives_one_process_logits_from_its_slices(tiny_models: list[Path], ranks: int) -> None:
    proc = subprocess.run(
        [str(LAUNCH), "--backend", "ring", "-n", str(ranks), "--starting-port", str(random.randrange(30000, 40000)),
         "--python", sys.executable, str(ROOT / "tests" / "_pipeline_ranks.py"), *map(str, tiny_models)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    report = json.loads(lines[-1])
    assert set(report) == set(ARCHITECTURES)
    for name, result in report.items():
        layers = ARCHITECTURES[name].layers
        assert result["slices"] == [list(s) for s in split(layers, ranks)], name
        assert result["shape"][1] == 12 + 3, name  # the prompt's 12 positions (two chunks), three steps
        assert result["diff"] == 0.0, (name, result)  # the same operations in the same order


@pytest.fixture(scope="module")
def default_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model store holding the default model as a fresh machine serves it (hard links)."""
    from tests.realmodels import smollm2_native_store

    stored = smollm2_native_store()
    home = tmp_path_factory.mktemp("home")
    (home / "models").mkdir()
    shutil.copytree(stored.path, home / "models" / stored.path.name, copy_function=os.link)
    return home


@needs_launch
def test_the_default_model_splits_by_layers_over_two_ranks_and_answers_as_one_process(default_home: Path) -> None:
    """What a new user tries first: ``scripts/serve-distributed 2`` with no model named.  Its 9
    heads and 3 key/value heads do not divide by 2, so it is split by layers, unasked."""
    env = {**os.environ, "TURBOSPARK_HOME": str(default_home), "MLX_RING_PORT": str(random.randrange(30000, 40000))}
    flags = ["--port", str(_port()), *NO_EXTRAS]
    single = Running([sys.executable, "-m", "turbospark", "serve", *flags], env)
    try:
        expected = _answers(single.url)
    finally:
        single.stop()
    sharded = Running([str(ROOT / "scripts" / "serve-distributed"), "2", *flags], env)
    try:
        sharded.follower_pid()  # rank 1 has said what it holds
        held = [line.split(": ")[-1].strip() for line in sharded.lines if "holds its shard of" in line]
        assert sorted(held) == ["layers 0 to 14 (pipeline sharding)", "layers 15 to 29 (pipeline sharding)"], held
        assert _answers(sharded.url) == expected
        assert any(len(answer) > 20 for answer in expected if isinstance(answer, str))  # real text, not one token
        # a client that leaves mid-stream is cancelled on both ranks; the next answers alike
        body = {"model": "any", "messages": [{"role": "user", "content": "Count to a thousand"}],
                "max_tokens": 400, "temperature": 0, "stream": True}
        with httpx.Client(timeout=60) as client, client.stream("POST", f"{sharded.url}/v1/chat/completions", json=body) as s:
            next(s.iter_lines())
        deadline = time.monotonic() + 30
        while _metric(sharded.url, "turbospark_cancellations_total") < 1:
            assert time.monotonic() < deadline, "the stream that was left was not cancelled"
            time.sleep(0.1)
        assert _answers(sharded.url)[:2] == expected[:2]
    finally:
        sharded.stop()
    assert "Traceback" not in "".join(sharded.lines)
