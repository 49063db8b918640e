"""Each model family's real chat template and output markup, on its imported tokenizer (sans-io).

For every family in :data:`tests.model.family_templates.FAMILIES`: the prompt of a conversation
with tools, an earlier call (and the reasoning before it) and its result carries them as the
template writes them; what the family's model writes, decoded token by token as the model thread
decodes it, parses into content, reasoning and calls, through the output parser configured as the
server configures it for that template (and the guardrails' rescue, for the forms only it reads).
"""

from __future__ import annotations

import json

import pytest

from tests.model.family_templates import (
    CONVERSATION,
    FAMILIES,
    TOOLS,
    Family,
    family_tokenizer,
)
from turbospark.model.output import OutputParser, Parts
from turbospark.turns.guardrails import Guardrails, Rescued, inspect

BY_ID = {f.id: f for f in FAMILIES}


@pytest.fixture(params=sorted(BY_ID), scope="module")
def family(request: pytest.FixtureRequest) -> Family:
    return BY_ID[request.param]


def test_the_prompt_carries_tools_the_earlier_call_and_its_result(family: Family) -> None:
    tok = family_tokenizer(family)
    prompt = tok.render_chat(CONVERSATION, tools=TOOLS, template_kwargs=family.flags)
    for text in family.rendered:
        assert text in prompt, f"{family.id}: {text!r} not in\n{prompt}"
    assert "12C and cloudy" in prompt and "Oslo" in prompt
    assert tok.opens_reasoning(prompt) == family.opens_reasoning


def parse(family: Family) -> tuple[Parts, str]:
    """What the server makes of the family's output: decoded a token at a time (special tokens
    as the model thread shows them), fed to the parser, then the guardrails' verdict."""
    tok = family_tokenizer(family)
    prompt = tok.render_chat(CONVERSATION, tools=TOOLS, template_kwargs=family.flags)
    parser = OutputParser(tok.dialect, tools=TOOLS, in_reasoning=tok.opens_reasoning(prompt))
    decoder = tok.stream_decoder()
    parts = Parts()
    for token in tok.encode(family.output):
        parts += parser.feed(decoder.add(token))
    parts += parser.feed(decoder.flush()) + parser.finish()
    return parts, prompt


def test_the_output_parses_into_typed_parts(family: Family) -> None:
    parts, _ = parse(family)
    verdict = inspect(content=parts.content, calls=parts.calls, tools=TOOLS, call_required=False,
                      guardrails=Guardrails(), new_id=lambda: "call_x")
    calls = parts.calls
    if family.rescued:
        assert not parts.calls and isinstance(verdict, Rescued), (family.id, parts, verdict)
        calls = verdict.calls
    else:
        assert not isinstance(verdict, Rescued), (family.id, verdict)
        assert parts.content.strip() == family.content, (family.id, parts)
    assert parts.reasoning.strip() == family.reasoning
    assert [(c.name, json.loads(c.arguments)) for c in calls] == list(family.calls)
    assert [c.index for c in parts.calls] == list(range(len(parts.calls)))
    for marker in ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<think>", "</think>", "<|tool_call|>"):
        if not family.rescued:
            assert marker not in parts.content + parts.reasoning


@pytest.mark.parametrize("step", [1, 3])
def test_the_parser_holds_markup_split_across_pieces(step: int) -> None:
    """Markup cut anywhere between pieces (Llama's tag, Mistral's header, Phi's block) never
    leaks into content."""
    for fid in ("llama3.1-python-tag", "mistral-small-3.2", "phi4-mini", "qwen3-thinking"):
        fam = BY_ID[fid]
        tok = family_tokenizer(fam)
        parser = OutputParser(tok.dialect, tools=TOOLS)
        parts = Parts()
        for at in range(0, len(fam.output), step):
            parts += parser.feed(fam.output[at : at + step])
        parts += parser.finish()
        assert parts.content.strip() == fam.content and parts.reasoning.strip() == fam.reasoning, fid
        assert [(c.name, json.loads(c.arguments)) for c in parts.calls] == list(fam.calls), fid


def test_dialects_follow_the_templates() -> None:
    names = {fid: family_tokenizer(BY_ID[fid]).dialect.name for fid in (
        "qwen2.5", "llama3.1-python-tag", "llama3.2-json", "mistral-nemo", "phi4-mini", "r1-distill-qwen")}
    assert names == {"qwen2.5": "hermes", "llama3.1-python-tag": "llama3", "llama3.2-json": "llama3",
                     "mistral-nemo": "mistral", "phi4-mini": "phi4_mini", "r1-distill-qwen": "hermes"}


def test_mistral_history_ids_are_nine_letters_and_digits_call_and_result_alike() -> None:
    tok = family_tokenizer(BY_ID["mistral-nemo"])
    prompt = tok.render_chat(CONVERSATION, tools=TOOLS)
    call_id = prompt.split('"id": "')[1][:9]
    assert call_id.isalnum() and f'"call_id": "{call_id}"' in prompt


def test_a_mistral_call_that_copies_the_history_call_id_still_parses() -> None:
    tok = family_tokenizer(BY_ID["mistral-small-3.2"])
    parser = OutputParser(tok.dialect, tools=TOOLS)
    parts = parser.feed('[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Oslo"}') + parser.finish()
    assert [(c.name, json.loads(c.arguments)) for c in parts.calls] == [("get_weather", {"city": "Oslo"})]
    assert parts.content == ""
