"""The sans-io pieces, tested directly: stop strings, the queue policy, SSE framing, the codec,
the streaming detokenizer, the routing policy, a sequence's own state and batch admission."""

from __future__ import annotations


import pytest

from turbospark.actors._fifo import FifoPolicy
from turbospark.wire.codec import structure
from turbospark.errors import ModelNotFound, NoModel, RequestInvalid
from turbospark.threads._admission import Admission
from turbospark.model.backend import PrefillProgress, SamplingParams
from turbospark.model.output import OutputParser
from turbospark.model.scripted import shipped_tokenizer
from turbospark.model.sequence import SequenceState
from turbospark.model.stops import StopMatcher
from turbospark.web import sse as _sse
from turbospark.actors.registry import ModelEntry, Registry
from turbospark.wire.openai import ChatCompletionRequest


def feed_all(matcher: StopMatcher, pieces: list[str]) -> str:
    out = "".join(matcher.feed(p) for p in pieces)
    return out + (matcher.flush() if matcher.matched is None else "")


@pytest.mark.parametrize(
    ("pieces", "stops", "text", "matched"),
    [
        (["hello wor", "ld"], ["world"], "hello ", "world"),
        (["ab", "c", "d"], ["cd", "bcx"], "ab", "cd"),
        (["wo", "rk done"], ["world"], "work done", None),
        (["a", "b"], [], "ab", None),
        (["stop here"], ["stop"], "", "stop"),
        (["x</", "s", ">y"], ["</s>"], "x", "</s>"),
        (["tail <"], ["<|end|>"], "tail <", None),  # a held tail is flushed at the end
    ],
)
def test_stop_matcher(pieces, stops, text, matched) -> None:
    m = StopMatcher(stops)
    assert feed_all(m, pieces) == text
    assert m.matched == matched


def test_stop_matcher_holds_back_only_what_could_still_match() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("abc ST") == "abc "
    assert m.feed("x") == "STx"


def test_fifo_policy_order_limit_withdraw() -> None:
    p: FifoPolicy[str] = FifoPolicy(limit=2)
    assert p.admit("m", "a") == 0
    assert p.admit("m", "b") == 1
    assert p.admit("m", "c") is None  # full
    assert p.admit("other", "x") == 0  # per model
    assert p.withdraw("m", "a") and not p.withdraw("m", "a")
    assert p.depth("m") == 1
    p.ask("m", 1)
    assert list(p.dispatch()) == [("m", ["b"])]
    assert p.depth("m") == 0 and list(p.dispatch()) == []
    p.ask("m", 2)
    # a credit of two: "d" and "e" will not wait, so two more fit before the limit
    assert [p.admit("m", j) for j in "defgh"] == [0, 1, 2, 3, None]
    assert list(p.dispatch()) == [("m", ["d", "e"])]
    # of what was sent, only what is still in the channel can be withdrawn: the last ones
    assert not p.withdraw("m", "b", unreceived=2) and p.withdraw("m", "e", unreceived=2)
    p.ask("m", -1, unreceived=2)  # asks for fewer: the credit goes below zero
    p.ask("m", 2)
    assert list(p.dispatch()) == [("m", ["f"])]
    p.requeue("m", ["f"])  # could not be sent: back at the head, and its credit back
    assert p.credit("m") == 1 and p.depth("m") == 2
    assert p.retire("m") == ["f", "g"] and p.credit("m") == 0
    assert p.drain() == ["x"]


def test_sse_framing() -> None:
    assert _sse.data({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert _sse.event("error", {"x": 1}) == b'event: error\ndata: {"x":1}\n\n'
    assert _sse.DONE == b"data: [DONE]\n\n"
    assert _sse.KEEPALIVE == b": keepalive\n\n"


def test_codec_refuses_coercions() -> None:
    base = {"messages": [{"role": "user", "content": "hi"}]}
    for field, value in [("stream", "false"), ("stream", 0), ("max_tokens", "2"), ("max_tokens", True),
                         ("temperature", "0.5"), ("model", 5)]:
        with pytest.raises(RequestInvalid) as err:
            structure(base | {field: value}, ChatCompletionRequest)
        assert f"body.{field}" in err.value.message
    ok = structure(base | {"max_tokens": 3.0, "temperature": 1}, ChatCompletionRequest)
    assert ok.max_tokens == 3 and ok.temperature == 1.0


def test_stream_decoder_never_splits_a_character() -> None:
    tok = shipped_tokenizer()
    text = "naïve café 🙂 日本語 done"
    ids = tok.encode(text)
    decoder = tok.stream_decoder()
    pieces = [decoder.add(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_chat_template_and_counts() -> None:
    tok = shipped_tokenizer()
    rendered = tok.render_chat([{"role": "user", "content": "Hi"}])
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(rendered)
    assert tok.encode("<|im_end|>") == [2] and 2 in tok.stop_ids
    assert ids.count(1) == 3  # <|im_start|> is one special token each time
    # special tokens are left out of decoded text
    assert tok.decode(ids) == (
        "system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face\n"
        "user\nHi\nassistant\n"
    )


def test_routing_policy() -> None:
    a = ModelEntry("a", 100, frozenset({"chat"}), ("claude-turbospark-a",))
    b = ModelEntry("b", 100, frozenset({"chat"}))
    base = ModelEntry("base", 100, frozenset({"completion"}))
    assert Registry((a,)).resolve("anything") is a
    two = Registry((a, b, base))
    assert two.resolve("claude-turbospark-a") is a
    assert two.resolve("base", "completion") is base
    with pytest.raises(ModelNotFound) as err:
        two.resolve("gpt-4o")
    assert err.value.available == ["a", "b"]
    with pytest.raises(NoModel):
        Registry((base,)).resolve("x", "chat")
    assert two.lookup("x") is None
    with pytest.raises(ValueError):
        Registry((a, a))


def test_template_flags_reach_the_template_but_never_replace_the_conversation() -> None:
    from tokenizers import Tokenizer as HF

    from turbospark.model.tokenizer import Tokenizer

    template = "{{ messages | length }}:{{ 'think' if enable_thinking else 'plain' }}:{{ effort }}"
    tok = Tokenizer(
        HF.from_file(str(shipped_tokenizer_path())),
        chat_template=template,
        bos_token=None,
        eos_token=None,
        add_bos_token=False,
    )
    msgs = [{"role": "user", "content": "x"}]
    flags = {"enable_thinking": True, "effort": "high"}
    assert tok.render_chat(msgs, template_kwargs=flags) == "1:think:high"
    hostile = {"messages": [], "enable_thinking": False, "effort": ""}
    assert tok.render_chat(msgs, template_kwargs=hostile) == "1:plain:"


def shipped_tokenizer_path():
    from turbospark.model.scripted import DATA_DIR

    return DATA_DIR / "tokenizer.json"


def test_sampling_defaults_request_then_model_then_server() -> None:
    from turbospark.routes._openai import sampling_params

    body = structure(
        {"messages": [{"role": "user", "content": "x"}], "top_p": 0.5, "stop": "END"},
        ChatCompletionRequest,
    )
    params = sampling_params(body, max_tokens=7, model_defaults={"temperature": 0.0, "top_p": 0.9})
    assert params.temperature == 0.0  # the model's own default
    assert params.top_p == 0.5  # the request wins
    assert params.top_k == 64 and params.max_tokens == 7 and params.stop == ("END",)  # the server's


def _sequence(**params: object) -> tuple[SequenceState, list[int]]:
    tok = shipped_tokenizer()
    state = SequenceState(
        params=SamplingParams(**params),  # type: ignore[arg-type]
        decoder=tok.stream_decoder(),
        stop_ids=tok.stop_ids,
        eos_id=tok.eos_id,
        prompt_tokens=5,
        created=0.0,
        parser=OutputParser(tok.dialect),
    )
    return state, tok.encode("The capital of France is Paris.")


def test_sequence_ends_on_its_budget_with_everything_shown() -> None:
    state, ids = _sequence(max_tokens=3)
    state.progress(PrefillProgress(5, 5, 2))
    texts = [state.feed(t, now=1.0).content for t in ids[:3]]
    assert "".join(texts) == shipped_tokenizer().decode(ids[:3])
    assert state.stop_reason == "MaxTokens" and state.finish_reason == "length"
    assert (state.new_tokens, state.cached, state.phase, state.prefill_end) == (3, 2, "decode", 1.0)


def test_sequence_holds_a_possible_stop_string_and_drops_a_matched_one() -> None:
    state, ids = _sequence(max_tokens=50, stop=("Paris",))
    out = ""
    for t in ids:
        out += state.feed(t).content
        if state.stop_reason is not None:
            break
    assert out == "The capital of France is " and state.stop_reason == "StopString"
    assert state.finish_reason == "stop"


def test_sequence_stop_token_flushes_the_held_tail() -> None:
    tok = shipped_tokenizer()
    state, ids = _sequence(max_tokens=50, stop=(".!",))
    out = "".join(state.feed(t).content for t in ids)
    assert out == "The capital of France is Paris"  # the "." could still become ".!"
    (end_of_turn,) = tok.encode("<|im_end|>")
    out += state.feed(end_of_turn).content
    assert out == "The capital of France is Paris."
    assert state.stop_reason == ("Eos" if end_of_turn == tok.eos_id else "EndOfTurn")
    state.end("Cancelled")  # an ended sequence keeps its reason
    assert state.stop_reason in ("Eos", "EndOfTurn")


def test_admission_slots_and_kv_budget_keep_arrival_order() -> None:
    # 1 byte per token; a batch costs its size times its longest sequence (rows are padded)
    a = Admission(max_batch=3, kv_budget=100)
    assert a.fits(500)  # alone, anything runs
    a.admit(1, 500)
    assert not a.fits(1)  # over the budget now
    a.release(1)
    a.admit(2, 40)
    assert a.fits(50) and not a.fits(51)  # 2 x 50 fits, 2 x 51 does not
    assert a.fits(10) and not a.fits(10, slots=2)  # 2 x 40 fits, 3 x 40 does not
    a.admit(3, 10)
    assert a.reserved == 80  # two rows padded to 40
    assert not a.fits(30)  # 3 x 40 = 120
    a.release(2)
    assert a.running == 1 and a.reserved == 10 and a.fits(50)
    assert a.cost([]) == 0
    with pytest.raises(ValueError):
        Admission(max_batch=0, kv_budget=1)
