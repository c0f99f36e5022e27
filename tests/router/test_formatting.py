"""Response bodies: a streamed completion's logprobs equal the whole response's; the
prompt's log-probs in OpenAI's echo and vLLM's prompt_logprobs shapes; the SSE line."""

from __future__ import annotations

import json
from types import SimpleNamespace

from proto import pdserve_pb2 as pb
from router.choices import Choice, ChoiceEvent
from router.formatting import Formatter, sse, vllm_prompt_logprobs

TOKEN_TEXT = {1: "ab", 2: "c", 3: "\ufffd", 4: "de", 5: "f"}


def _Text(text: str) -> SimpleNamespace:  # a finished detokenizer
    return SimpleNamespace(text=text)


def test_streamed_text_offsets_equal_the_whole_responses():
    """The text a chunk carries may lag its tokens (held back for a possible stop string
    or an incomplete character); offsets follow the tokens either way."""
    logprobs = [pb.TokenLogprobs(token_id=t, logprob=-0.5) for t in TOKEN_TEXT]
    # Text by chunk as a detokenizer holding back "c?" (a stop string's prefix) sends it.
    chunks = [([1], "ab"), ([2], ""), ([3], "c\ufffd"), ([4, 5], "def")]
    request = SimpleNamespace(prompt_token_ids=[7, 8])
    choice = Choice(0, 0, request, _Text("abc\ufffddef"), token_ids=list(TOKEN_TEXT),
                    logprobs=logprobs, finish_reason="length")  # fmt: skip
    streamed = Formatter("cmpl-1", "m", chat=False, logprobs=0, token_text=TOKEN_TEXT.get)
    offsets, position = [], 0
    for token_ids, text in chunks:
        lps = logprobs[position : position + len(token_ids)]
        position += len(token_ids)
        body = streamed.chunk(ChoiceEvent(choice, text, token_ids, lps))
        offsets += body["choices"][0]["logprobs"]["text_offset"]
    whole = Formatter("cmpl-2", "m", chat=False, logprobs=0, token_text=TOKEN_TEXT.get)
    final = whole.final([choice])["choices"][0]["logprobs"]
    assert offsets == final["text_offset"] == [0, 2, 3, 4, 6]


def test_prompt_logprobs_take_vllms_shape_and_echo_cuts_its_own_top():
    """Scored once with the larger top n (3, for prompt_logprobs); echo's logprobs=1 shows
    one top entry and the prompt token; vLLM's field shows the token and the top 3, the
    token once when it is among them."""
    scored = [
        pb.TokenLogprobs(token_id=2, logprob=-0.5, rank=1, top_token_ids=[2, 4, 5],
                         top_logprobs=[-0.5, -2.5, -3.0]),
        pb.TokenLogprobs(token_id=1, logprob=-4.0, rank=7, top_token_ids=[4, 5, 2],
                         top_logprobs=[-0.25, -1.5, -2.0]),
    ]  # fmt: skip
    request = SimpleNamespace(prompt_token_ids=[5, 2, 1])
    choice = Choice(0, 0, request, _Text("c"), token_ids=[2], finish_reason="length",
                    logprobs=[pb.TokenLogprobs(token_id=2, logprob=-0.75, top_token_ids=[2],
                                               top_logprobs=[-0.75])],
                    prompt_logprobs=scored)  # fmt: skip
    formatter = Formatter("cmpl-1", "m", chat=False, logprobs=1, token_text=TOKEN_TEXT.get,
                          echo=["fabc"], prompt_logprobs=3)  # fmt: skip
    (body,) = formatter.final([choice])["choices"]
    assert body["text"] == "fabcc"
    assert body["logprobs"]["top_logprobs"] == [None, {"c": -0.5}, {"de": -0.25, "ab": -4.0},
                                                {"c": -0.75}]  # fmt: skip
    assert body["prompt_logprobs"] == [
        None,
        {"2": {"logprob": -0.5, "rank": 1, "decoded_token": "c"},
         "4": {"logprob": -2.5, "rank": 2, "decoded_token": "de"},
         "5": {"logprob": -3.0, "rank": 3, "decoded_token": "f"}},
        {"1": {"logprob": -4.0, "rank": 7, "decoded_token": "ab"},
         "4": {"logprob": -0.25, "rank": 1, "decoded_token": "de"},
         "5": {"logprob": -1.5, "rank": 2, "decoded_token": "f"},
         "2": {"logprob": -2.0, "rank": 3, "decoded_token": "c"}},
    ]  # fmt: skip
    assert vllm_prompt_logprobs(scored, TOKEN_TEXT.get, 0) == [
        None,
        {"2": {"logprob": -0.5, "rank": 1, "decoded_token": "c"}},
        {"1": {"logprob": -4.0, "rank": 7, "decoded_token": "ab"}},
    ]
    chat = Formatter("chatcmpl-1", "m", chat=True, logprobs=None, token_text=TOKEN_TEXT.get,
                     prompt_logprobs=0)  # fmt: skip
    whole = chat.final([choice])
    assert whole["prompt_logprobs"] == vllm_prompt_logprobs(scored, TOKEN_TEXT.get, 0)
    assert "prompt_logprobs" not in whole["choices"][0]


def test_an_sse_line_is_one_json_event_in_utf_8():
    """Non-ASCII text goes as UTF-8 (not escaped), and what JSON cannot hold (NaN, an
    infinity) goes as null rather than as invalid JSON."""
    body = {"choices": [{"delta": {"content": "é\u2028 \"q\"\n"}, "logprobs": None}],
            "created": 1, "x": [float("nan"), float("-inf"), 0.5]}  # fmt: skip
    line = sse(body)
    assert line.startswith(b"data: {") and line.endswith(b"}\n\n") and line.count(b"\n") == 2
    assert "é".encode() in line
    assert json.loads(line[len(b"data: ") :]) == {**body, "x": [None, None, 0.5]}


def test_chat_logprobs_bytes_rebuild_a_character_split_across_tokens(tiny_llama):
    """OpenAI's ``bytes``: each token's own bytes, so that joined they rebuild what the
    tokens' texts cannot (each of the three tokens of "世" reads U+FFFD). They were the
    bytes of U+FFFD."""
    from common.tokenizer import Tokenizer

    tokenizer = Tokenizer(tiny_llama)
    ids = tokenizer.encode("a 世界", add_special_tokens=False)
    logprobs = [pb.TokenLogprobs(token_id=t, logprob=-0.5) for t in ids]
    request = SimpleNamespace(prompt_token_ids=[7, 8])
    choice = Choice(0, 0, request, _Text("a 世界"), token_ids=ids, logprobs=logprobs,
                    finish_reason="length")  # fmt: skip
    formatter = Formatter("chatcmpl-1", "m", chat=True, logprobs=0,
                          token_text=tokenizer.pieces.text,
                          token_bytes=tokenizer.pieces.bytes)  # fmt: skip
    content = formatter.final([choice])["choices"][0]["logprobs"]["content"]
    assert "\ufffd" in "".join(entry["token"] for entry in content)
    assert bytes(b for entry in content for b in entry["bytes"]).decode() == "a 世界"


def _sdk_events(bodies: list[dict]) -> tuple[list[str], object]:
    """``bodies`` read by the OpenAI SDK's stream helper (``client.chat.completions
    .stream``): its event types and its final completion."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    state = ChatCompletionStreamState()
    kinds = [event.type for body in bodies
             for event in state.handle_chunk(ChatCompletionChunk.model_validate(body))]  # fmt: skip
    return kinds, state.get_final_completion()


def test_a_stream_opens_every_choice_in_index_order():
    """n = 2 with choice 1's text first (choice 0's held back for a tool call or a
    constraint): the SDK's stream helper fills its choices in the order they first come
    and failed with an IndexError. Each choice's role goes out first, as vLLM sends it."""
    request = SimpleNamespace(prompt_token_ids=[1])
    choices = [Choice(i, 0, request, SimpleNamespace(text=""), token_ids=[], logprobs=[])
               for i in range(2)]  # fmt: skip
    formatter = Formatter("chatcmpl-1", "m", chat=True, logprobs=None, token_text=str)
    bodies = formatter.opening(choices)
    assert [b["choices"][0]["delta"] for b in bodies] == [{"role": "assistant", "content": ""}] * 2
    for index, text, finish in ((1, "one", None), (0, "zero", None), (1, "!", "stop"),
                                (0, "?", "stop")):  # fmt: skip
        bodies += formatter.chunks(ChoiceEvent(choices[index], text, [5], [], finish))
    assert all("role" not in b["choices"][0]["delta"] for b in bodies[2:])
    _, final = _sdk_events(bodies)
    assert [c.message.content for c in final.choices] == ["zero?", "one!"]
    counted = Formatter("chatcmpl-2", "m", chat=True, logprobs=None, token_text=str)
    usage = counted.opening(choices, usage=True)[1]["usage"]  # (continuous usage stats)
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (1, 0)


def test_a_call_and_the_finish_reason_go_out_in_two_chunks():
    """The last call, in the chunk that said the finish reason: the SDK's stream helper
    reads the reason first and never sent that call's ``arguments.done``."""
    from router.tool_parsers import HermesCalls

    call = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    request = SimpleNamespace(prompt_token_ids=[1])
    choice = Choice(0, 0, request, SimpleNamespace(text=""), token_ids=[], logprobs=[])
    formatter = Formatter("chatcmpl-1", "m", chat=True, logprobs=None, token_text=str,
                          tools=HermesCalls())  # fmt: skip
    bodies = [*formatter.opening([choice]), *formatter.chunks(ChoiceEvent(choice, "Hi", [5], []))]
    last = formatter.chunks(ChoiceEvent(choice, call, [6], [], "stop"))
    assert [(b["choices"][0]["finish_reason"], "tool_calls" in b["choices"][0]["delta"])
            for b in last] == [(None, True), ("tool_calls", False)]  # fmt: skip
    kinds, final = _sdk_events(bodies + last)
    assert kinds.count("tool_calls.function.arguments.done") == 1, kinds
    assert final.choices[0].message.tool_calls[0].function.arguments == '{"x": 1}'


def test_a_body_encoded_in_slices_is_the_body_encoded_whole():
    from router.formatting import json_bytes

    long = [None, *({str(i): {"logprob": -0.5, "rank": i}} for i in range(5000))]
    body = {"id": "x", "choices": [{"index": 0, "prompt_logprobs": long, "empty": [],
                                    "nested": [[1, 2], [3]], "nan": float("nan")}],
            "usage": {}, "text": "é\\n"}  # fmt: skip
    assert json_bytes(body, sliced=True) == json_bytes(body)
    assert json.loads(json_bytes(body, sliced=True))["choices"][0]["prompt_logprobs"] == json.loads(
        json.dumps(long)
    )
