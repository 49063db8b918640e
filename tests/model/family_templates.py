"""Model families as an imported GGUF gives them to the server: the family's real chat template
over its vocabulary, and the text its model writes (tool calls, reasoning).

The templates are the ones llama.cpp ships (``models/templates``, fetched with
:func:`tests.model.gguf_fixtures.llama_cpp_templates`), except Phi-4-mini's and Gemma 3's, which
llama.cpp does not ship: those are copied below from the models' ``tokenizer_config.json``.
Tokenizers are built from llama.cpp's vocabulary fixtures by the GGUF import
(:mod:`turbospark.store.gguf_tokenizer`), with the chat template in the metadata as a GGUF carries
it.  Where a family's tokenizer only named tokens its base left reserved or padding (Llama 3.1's
``<|python_tag|>``, Qwen 2.5's ``<tool_call>``, Qwen 3's ``<think>``), they are renamed at their
ids, so the markup is one special token as in the real model.  Gemma 3's vocabulary is the stored
Gemma 3 270M's (:func:`tests.realmodels.gemma_store`).
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import attrs

from tests.model.gguf_fixtures import llama_cpp_sources, llama_cpp_templates
from turbospark.model.tokenizer import Tokenizer
from turbospark.store.gguf_reader import read_gguf
from turbospark.store.gguf_tokenizer import (
    end_of_generation_ids,
    save_tokenizer,
    tokenizer_config,
)

__all__ = ["CONVERSATION", "FAMILIES", "TOOLS", "Family", "family_tokenizer"]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]

# A conversation as the chat route hands it to the template: an earlier call (with the reasoning
# that led to it) and its result.
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "12C and cloudy"},
]

# microsoft/Phi-4-mini-instruct, tokenizer_config.json
PHI4_MINI = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and "
    "message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + "
    "message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + "
    "message['content'] + '<|end|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)

# google/gemma-3-*-it, tokenizer_config.json
GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

# Tokens a family's tokenizer names where its base vocabulary has a reserved or padding entry.
_LLAMA31 = {128004: "<|finetune_right_pad_id|>", 128008: "<|eom_id|>", 128010: "<|python_tag|>"}
_QWEN25 = {151657: "<tool_call>", 151658: "</tool_call>"}
_QWEN3 = {**_QWEN25, 151665: "<tool_response>", 151666: "</tool_response>", 151667: "<think>", 151668: "</think>"}

_ONE_CALL = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
_QWEN_CALLS = f'<tool_call>\n{_ONE_CALL}\n</tool_call>\n<tool_call>\n{{"name": "get_time", "arguments": {{"zone": "CET"}}}}\n</tool_call>'
BOTH = (("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"}))
OSLO = (("get_weather", {"city": "Oslo"}),)


@attrs.frozen
class Family:
    """One family's template and what its model writes.  ``output`` parses (the output parser,
    then the guardrails' rescue when ``rescued``) into ``content``, ``reasoning`` and ``calls``
    (compared stripped; calls as (name, arguments)); ``rendered`` are texts the prompt of
    ``CONVERSATION`` with ``TOOLS`` must carry, as the template writes them."""

    id: str
    template: str  # a file in llama.cpp's models/templates, or the template itself
    vocab: str  # a llama.cpp vocabulary fixture, or "gemma3"
    output: str
    rendered: tuple[str, ...] = ()
    content: str = ""
    reasoning: str = ""
    calls: tuple[tuple[str, dict[str, Any]], ...] = ()
    flags: dict[str, Any] = attrs.field(factory=dict)
    renames: dict[int, str] = attrs.field(factory=dict)
    rescued: bool = False
    opens_reasoning: bool = False

    def template_text(self) -> str:
        if self.template.endswith(".jinja"):
            return (llama_cpp_templates() / self.template).read_text()
        return self.template


_QWEN_RENDERED = (
    '<tools>\n{"type": "function", "function": {"name": "get_weather"',
    f"<|im_start|>assistant\n<tool_call>\n{_ONE_CALL}\n</tool_call><|im_end|>",
    "<|im_start|>user\n<tool_response>\n12C and cloudy\n</tool_response><|im_end|>",
)
_LLAMA_RENDERED = (
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}',
    '"name": "get_time"',
    '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Oslo"}}<|eot_id|>',
    '<|start_header_id|>ipython<|end_header_id|>\n\n"12C and cloudy"<|eot_id|>',
)
_PREAMBLE_RENDERED = (
    'You can call these tools:\n<tools>\n{"name": "get_weather"',
    f"<tool_call>\n{_ONE_CALL}\n</tool_call>",
    "<tool_response>\n12C and cloudy\n</tool_response>",
)
_R1 = "deepseek-ai-DeepSeek-R1-Distill-{}.jinja"

FAMILIES = [
    Family("qwen2.5", "Qwen-Qwen2.5-7B-Instruct.jinja", "qwen2", f"Let me check both.\n{_QWEN_CALLS}",
           _QWEN_RENDERED, content="Let me check both.", calls=BOTH, renames=_QWEN25),
    Family("qwen3-thinking", "Qwen-Qwen3-0.6B.jinja", "qwen2",
           f"<think>\nOslo, and the time there.\n</think>\n\nChecking.\n{_QWEN_CALLS}",
           (_QWEN_RENDERED[0], _QWEN_RENDERED[2],
            f"<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n<tool_call>\n{_ONE_CALL}\n</tool_call><|im_end|>"),
           content="Checking.", reasoning="Oslo, and the time there.", calls=BOTH, renames=_QWEN3),
    Family("qwen3-no-thinking", "Qwen-Qwen3-0.6B.jinja", "qwen2", "It is 12C and cloudy.",
           ("<|im_start|>assistant\n<think>\n\n</think>\n\n",), content="It is 12C and cloudy.",
           flags={"enable_thinking": False, "reasoning_effort": "none"}, renames=_QWEN3),
    Family("llama3.1-python-tag", "meta-llama-Llama-3.1-8B-Instruct.jinja", "llama-bpe",
           '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
           '{"name": "get_time", "parameters": {"zone": "CET"}}',
           _LLAMA_RENDERED, calls=BOTH, renames=_LLAMA31),
    Family("llama3.2-json", "meta-llama-Llama-3.2-3B-Instruct.jinja", "llama-bpe",
           '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
           _LLAMA_RENDERED, calls=OSLO, renames=_LLAMA31, rescued=True),
    Family("mistral-nemo", "mistralai-Mistral-Nemo-Instruct-2407.jinja", "llama-spm",
           '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "a1b2c3d4e"}, '
           '{"name": "get_time", "arguments": {"zone": "CET"}, "id": "f5g6h7i8j"}]',
           ("[AVAILABLE_TOOLS]", '"name": "get_time"', '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "',
            '[TOOL_RESULTS]{"content": 12C and cloudy, "call_id": "'), calls=BOTH),
    Family("mistral-small-3.2", "Mistral-Small-3.2-24B-Instruct-2506.jinja", "llama-spm",
           'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
           ("[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][AVAILABLE_TOOLS]", '"name": "get_time"',
            '[TOOL_CALLS]get_weather[CALL_ID]', '[ARGS]{"city": "Oslo"}</s>[TOOL_RESULTS]',
            "[TOOL_CONTENT]12C and cloudy[/TOOL_RESULTS]"), content="Checking.", calls=BOTH),
    Family("phi4-mini", PHI4_MINI, "phi-3",
           '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
           '{"name": "get_time", "arguments": {"zone": "CET"}}]<|/tool_call|>',
           ('<|system|>Be brief.<|tool|>[{"name": "get_weather"', '"name": "get_time"', "}]<|/tool|><|end|>",
            f"<|assistant|><|tool_call|>[{_ONE_CALL}]<|/tool_call|><|end|>",
            "<|user|><tool_response>\n12C and cloudy\n</tool_response><|end|><|assistant|>"), calls=BOTH),
    Family("gemma3-tool-call", GEMMA3, "gemma3", f"Sure.\n<tool_call>\n{_ONE_CALL}\n</tool_call>",
           ("<start_of_turn>user\nBe brief.\n\nYou can call these tools:", f"<start_of_turn>model\n<tool_call>\n{_ONE_CALL}",
            "<start_of_turn>user\n<tool_response>\n12C and cloudy\n</tool_response><end_of_turn>\n<start_of_turn>model\n"),
           content="Sure.", calls=OSLO),
    Family("gemma3-tool-code", GEMMA3, "gemma3",
           '```tool_code\nget_weather(city="Oslo")\nget_time(zone="CET")\n```', calls=BOTH, rescued=True),
    Family("r1-distill-qwen", _R1.format("Qwen-32B"), "qwen2",
           "Oslo first.\n</think>\n\n" + f"<tool_call>\n{_ONE_CALL}\n</tool_call>",
           (*_PREAMBLE_RENDERED, "<｜Assistant｜><think>\n"), reasoning="Oslo first.", calls=OSLO,
           opens_reasoning=True),
    Family("r1-distill-llama", _R1.format("Llama-8B"), "llama-bpe", "Easy.\n</think>\n\nIt is 12C.",
           _PREAMBLE_RENDERED, content="It is 12C.", reasoning="Easy.", opens_reasoning=True),
    Family("r1-distill-qwen-no-thinking", _R1.format("Qwen-32B"), "qwen2", "It is 12C.",
           ("<｜Assistant｜><think>\n</think>",), content="It is 12C.", flags={"enable_thinking": False}),
]


@functools.cache
def _imported(vocab: str, renames: tuple[tuple[int, str], ...]) -> tuple[dict[str, bytes], dict[str, Any]]:
    """The files the GGUF import writes for a vocabulary fixture's tokenizer (built once, kept in
    memory: the test process ends without ``atexit``, see conftest)."""
    md = dict(read_gguf(llama_cpp_sources() / "models" / f"ggml-vocab-{vocab}.gguf").metadata)
    if renames:
        tokens = list(md["tokenizer.ggml.tokens"])
        types = list(md["tokenizer.ggml.token_type"])
        for at, name in renames:
            tokens[at] = name
            types[at] = 3 if name.startswith("<|") else 4  # control, or user-defined as Qwen's are
        md |= {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}
    with tempfile.TemporaryDirectory(prefix=f"family-{vocab}-") as name:
        save_tokenizer(md, Path(name))
        files = {"tokenizer.json": (Path(name) / "tokenizer.json").read_bytes(),
                 "config.json": json.dumps({"eos_token_id": end_of_generation_ids(md)}).encode()}
    return files, md


def family_tokenizer(family: Family) -> Tokenizer:
    """``family``'s tokenizer as an import of its GGUF would write it, chat template included
    (written to a directory that is gone once the tokenizer has read it)."""
    with tempfile.TemporaryDirectory(prefix=f"family-{family.id}-") as name:
        directory = Path(name)
        if family.vocab == "gemma3":
            from tests.realmodels import gemma_store

            source = gemma_store().path
            shutil.copy(source / "tokenizer.json", directory)
            config = json.loads((source / "tokenizer_config.json").read_text())
        else:
            files, md = _imported(family.vocab, tuple(sorted(family.renames.items())))
            for file, data in files.items():
                (directory / file).write_bytes(data)
            config = tokenizer_config({**md, "tokenizer.chat_template": family.template_text()})
        config["chat_template"] = family.template_text()
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
        return Tokenizer.from_dir(directory)
