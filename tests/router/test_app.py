"""The gateway's HTTP surface in-process, with no workers behind it: every refusal is a 400
(or 404, 405, 500) in OpenAI's error envelope naming the field at fault, and requests that
pass validation reach placement (here: a 503, as no worker is up)."""

from __future__ import annotations

import asyncio
import json as jsonlib
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from common.config import Role
from common.config_base import ConfigError
from common.config_loader import load_config
from common.registry import WorkerInfo
from proto import pdserve_pb2 as pb
from router.app import create_app
from router.pooling_protocol import EmbeddingRequest
from router.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from router.responses_protocol import ResponsesRequest
from router.state import RouterState
from router.workers import WorkerState


@pytest.fixture(scope="module")
def state(tiny_llama) -> RouterState:
    return RouterState.build(load_config(None, [f"model={tiny_llama}"]))


def post(state: RouterState, path: str, json: object = None, raises: bool = False,
         **kwargs) -> httpx.Response:  # fmt: skip
    """``json`` is sent with ASCII escapes, so lone surrogates travel as a client's would.
    ``raises``: an exception the app raised on after answering (a bug's 500 does, and the
    server then logs its traceback) is raised here."""
    if json is not None:
        kwargs["content"] = jsonlib.dumps(json)
        kwargs["headers"] = {"content-type": "application/json", **kwargs.get("headers", {})}

    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(create_app(state), raise_app_exceptions=raises)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            return await client.request(kwargs.pop("method", "POST"), path, **kwargs)

    return asyncio.run(send())


def error_of(reply: httpx.Response, status: int) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


def test_nulls_pass_validation(state):
    body = {"prompt": "x", "n": None, "stream": None, "echo": None, "min_tokens": None,
            "stream_options": None, "max_tokens": None}  # fmt: skip
    assert error_of(post(state, "/v1/completions", json=body), 503)["code"] == "service_unavailable"
    chat = {"messages": [{"role": "user", "content": "x"}], "logprobs": None, "n": None}
    assert error_of(post(state, "/v1/chat/completions", json=chat), 503)


def test_refusals_name_their_field(state):
    chat = [{"role": "user", "content": "x"}]
    cases = [
        ("/v1/completions", {"prompt": "x", "guided_regex": "[a-"}, "guided_regex"),
        ("/v1/chat/completions", {"messages": chat, "response_format": {"type": "json_schema"}},
         "response_format"),
        ("/v1/completions", {"prompt": "x", "guided_choice": ["a"], "guided_regex": "a"},
         "guided_choice"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"10000000": 2}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "allowed_token_ids": [10**7]}, "allowed_token_ids"),
        ("/v1/completions", {"prompt": "x", "suffix": "!"}, "suffix"),
        ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
        ("/v1/completions", {"prompt": "x", "cache_salt": "\udfff"}, "cache_salt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800"}]},
         "messages"),
        ("/v1/chat/completions", {"messages": chat, "tools": [{"type": "function"}]}, "tools"),
        ("/v1/chat/completions", {"messages": chat, "tools": [  # "auto" without a parser
            {"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),  # as chat refuses them
        ("/v1/chat/completions", {"messages": chat, "continue_final_message": True},
         "continue_final_message"),  # (and add_generation_prompt, true by default)
        # The default policy (fcfs) takes no priority, whichever API carries it.
        ("/v1/completions", {"prompt": "x", "priority": -1}, "priority"),
        ("/v1/chat/completions", {"messages": chat, "priority": 3}, "priority"),
        ("/v1/responses", {"input": "x", "priority": 3}, "priority"),
        ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 10**6},
         "truncate_prompt_tokens"),
    ]  # fmt: skip
    for path, body, param in cases:
        error = error_of(post(state, path, json=body), 400)
        assert error["param"] == param, (body, error)


def test_refusals_say_what_is_wrong(state):
    """An API probe found a text part without text called "not supported", and a schema
    given as a string that is not JSON blamed the whole response_format."""
    text_part = [{"role": "user", "content": [{"type": "text"}]}]
    error = error_of(post(state, "/v1/chat/completions", json={"messages": text_part}), 400)
    assert "needs its 'text' string" in error["message"] and error["param"] == "messages"
    chat = [{"role": "user", "content": "x"}]
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": "str"}}
    body = {"messages": chat, "response_format": schema}
    error = error_of(post(state, "/v1/chat/completions", json=body), 400)
    assert error["message"].startswith("response_format.json_schema.schema must be a JSON schema")
    assert error["param"] == "response_format"
    # Too many sequences: blamed on n where n multiplies them, else on the prompt list.
    limit = state.config.router.max_inflight_sequences
    for body, param in [({"prompt": ["x"] * (limit + 1)}, "prompt"),
                        ({"prompt": ["x"] * (limit // 128 + 1), "n": 128}, "n")]:  # fmt: skip
        error = error_of(post(state, "/v1/completions", json=body), 400)
        assert "sequences" in error["message"] and error["param"] == param
    # Token ids are integers, as a prompt's are: "65", 66.0 and true were read as ids
    # (true as 1, the BOS, which allowed_token_ids then let the model write).
    for path, body, param in [("/detokenize", {"tokens": [65, "66"]}, "tokens"),
                              ("/v1/completions", {"prompt": "x", "allowed_token_ids": [True]},
                               "allowed_token_ids"),
                              ("/v1/completions", {"prompt": "x", "stop_token_ids": [2.0]},
                               "stop_token_ids")]:  # fmt: skip
        error = error_of(post(state, path, json=body), 400)
        assert "expected an integer" in error["message"] and error["param"] == param, error


def test_a_value_of_the_wrong_type_is_named_where_it_is_with_the_types_that_fit(state):
    """pydantic reports a value that fits no member of a union once per member: the
    first of them, passed on, said "Input should be a valid string" of a token id 1.5
    and of a chat's image given as a number, and named no place in the body."""
    chat = [{"role": "user", "content": "x"}]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": 5}]}]
    cases = [
        ("/v1/embeddings", {"input": [1.5]},
         "input[0]: expected a string, an integer or a list, got a number", "input"),
        ("/v1/completions", {"prompt": [1, 2, "x"]},
         "prompt[2]: expected an integer or a list, got a string", "prompt"),
        ("/v1/completions", {"prompt": [[1], [2, None]]},
         "prompt[1][1]: expected an integer, got null", "prompt"),
        ("/v1/chat/completions", {"messages": image},
         "messages[0].content[0].image_url: expected an object or a string, got an integer",
         "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]},
         "messages[0].role is required", "messages"),
        ("/v1/chat/completions", {"messages": chat, "stop": 5},
         "stop: expected a string or a list, got an integer", "stop"),
        ("/v1/rerank", {"query": "q", "documents": ["a", True]},
         "documents[1]: expected a string or an object, got a boolean", "documents"),
        ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
         "input[0].content[0]: a part of type 'input_text' needs its 'text' string", "input"),
        ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c"}]},
         "input[0].output must be a string or a list of parts", "input"),
    ]  # fmt: skip
    for path, body, message, param in cases:
        error = error_of(post(state, path, json=body), 400)
        assert (error["message"], error["param"]) == (message, param), (body, error)


def test_one_bad_item_in_a_long_prompt_list_is_one_error(state):
    """pydantic's union tried every shape on every item: one bad item at the end of
    300,000 token-id lists gave 600,000 errors (14 s of the router's event loop, 800 MB).
    A long list is read in its first item's shape; a short one keeps the union's
    message (the test above)."""
    bad_last = [[5]] * 100_000 + [[5.5]]
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": bad_last})
    assert len(info.value.errors()) == 1
    # Every item bad but the first: one slice's errors (they were 100,000; 5 s a 1.5 MB body).
    for all_bad in ([1] + ["a"] * 100_000, [[1]] + [1] * 100_000):
        with pytest.raises(ValidationError) as info:
            CompletionRequest.model_validate({"prompt": all_bad})
        assert len(info.value.errors()) <= 256
        assert info.value.errors()[0]["loc"] == ("prompt", 1)
    cases = [
        ("/v1/completions", {"prompt": bad_last},
         "prompt[100000][0]: expected an integer, got a number"),
        ("/v1/embeddings", {"input": ["x"] * 100 + [7]},
         "input[100]: expected a string, got an integer"),
        ("/v1/embeddings", {"input": [1] * 100 + [[2]]},
         "input[100]: expected an integer, got a list"),
        ("/v1/completions", {"prompt": [1.5] * 100},
         "prompt[0]: expected a string, an integer or a list, got a number"),
    ]  # fmt: skip
    for path, body, message in cases:
        error = error_of(post(state, path, json=body), 400)
        assert error["message"] == message, (body, error)
    assert CompletionRequest.model_validate({"prompt": [[1, 2]] * 100}).prompt == [[1, 2]] * 100


def test_a_responses_refusal_from_the_chat_path_names_the_responses_fields(state):
    """Its param was renamed and its message was not: "response_format.json_schema.schema
    is required", a field a Responses client never sent."""
    body = {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}
    error = error_of(post(state, "/v1/responses", json=body), 400)
    assert error["param"] == "text"
    assert error["message"] == "text.format.schema is required with type json_schema"


def test_browsers_of_the_allowed_origins_may_call_the_api(tiny_llama):
    """``router.allowed_origins`` (vLLM answers every origin by default): a preflight is
    answered before the key check (a browser sends none with it), and answers carry the
    origin; without the setting no CORS header goes out (a preflight meets the key check)."""
    keyed = [f"model={tiny_llama}", "router.api_keys=[sk-1]"]
    state = RouterState.build(
        load_config(None, [*keyed, "router.allowed_origins=[https://ui.example]"])
    )
    preflight = {"origin": "https://ui.example", "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}  # fmt: skip
    reply = post(state, "/v1/chat/completions", method="OPTIONS", headers=preflight)
    assert reply.status_code == 200
    assert reply.headers["access-control-allow-origin"] == "https://ui.example"
    headers = {"origin": "https://ui.example", "authorization": "Bearer sk-1"}
    reply = post(state, "/v1/models", method="GET", headers=headers)
    assert reply.status_code == 200
    assert reply.headers["access-control-allow-origin"] == "https://ui.example"
    other = post(
        state, "/v1/models", method="GET", headers={**headers, "origin": "https://x.example"}
    )
    assert "access-control-allow-origin" not in other.headers
    closed = RouterState.build(load_config(None, keyed))
    refused = post(closed, "/v1/chat/completions", method="OPTIONS", headers=preflight)
    assert refused.status_code == 401 and "access-control-allow-origin" not in refused.headers
    with pytest.raises(ConfigError, match="router.allowed_origins"):
        load_config(None, [f"model={tiny_llama}", "router.allowed_origins=[ui.example/x]"])


def test_lists_that_cost_work_per_entry_are_bounded(state, monkeypatch):
    """Lists the router tokenizes or compiles, or every worker goes over at every step,
    are bounded: a million bad words stalled the router for 31 s, four million repeats of
    one allowed id slowed every batch they joined, a choice of 100,000 strings compiled
    for 35 s. Too many prompts are refused before any is tokenized (2,000,000: 13 s)."""
    from router.prompts import PromptTokenizer

    cases = [
        ({"bad_words": ["w"] * 4097}, "bad_words", "at most 4096 words"),
        ({"bad_words": ["w" * 257]}, "bad_words", "at most 256 characters"),
        ({"stop_token_ids": [5] * 1025}, "stop_token_ids", "at most 1024"),
        ({"allowed_token_ids": [5] * (2**18 + 1)}, "allowed_token_ids", "at most 262144"),
        ({"logit_bias": {str(i): 1 for i in range(2**18 + 1)}}, "logit_bias", "at most"),
        ({"guided_choice": [f"option number {i}" for i in range(20_000)]}, "guided_choice",
         "too large: at most 256 KiB"),
        ({"structured_outputs": {"grammar": "start: " + "|".join(["x"] * 140_000)}},
         "structured_outputs", "too large"),
    ]  # fmt: skip
    for extra, param, message in cases:
        error = error_of(post(state, "/v1/completions", json={"prompt": "x", **extra}), 400)
        assert error["param"] == param and message in error["message"], (param, error)
    # Within the bounds: past validation to placement (no worker here: a 503).
    body = {"prompt": "x", "bad_words": ["w"] * 4096, "allowed_token_ids": [5] * 1000}
    assert error_of(post(state, "/v1/completions", json=body), 503)

    def tokenized(*args, **kwargs):
        raise AssertionError("the prompts were tokenized before the count was checked")

    monkeypatch.setattr(PromptTokenizer, "completion", tokenized)
    limit = state.config.router.max_inflight_sequences
    for prompt in (["x"] * (limit + 1), [[5, 6]] * (limit + 1)):
        error = error_of(post(state, "/v1/completions", json={"prompt": prompt}), 400)
        assert "sequences" in error["message"] and error["param"] == "prompt"


def test_a_tools_constraint_is_bounded_and_compiles_on_its_own_threads(state, monkeypatch):
    """A named function's schema is bounded as ``guided_json`` is (a 590 KB one compiled
    for 19 s where guided_json was a 400), and constraints compile on threads of their
    own: on the shared pool, slow compiles held every request's tokenizing."""
    import threading

    import router.generation_routes as routes

    properties = {f"field_{i:05d}": {"type": "string"} for i in range(12_000)}
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": properties}}}  # fmt: skip
    for choice in ({"type": "function", "function": {"name": "f"}}, "required"):
        body = {"messages": [{"role": "user", "content": "x"}], "tools": [tool],
                "tool_choice": choice}  # fmt: skip
        error = error_of(post(state, "/v1/chat/completions", json=body), 400)
        assert error["param"] == "tools" and "too large" in error["message"], error
    threads = []
    check = routes.check_constraint

    def recorded(*args):
        threads.append(threading.current_thread().name)
        return check(*args)

    monkeypatch.setattr(routes, "check_constraint", recorded)
    body = {"prompt": "x", "guided_regex": "[ab]+"}
    assert error_of(post(state, "/v1/completions", json=body), 503)  # (no worker here)
    assert len(threads) == 1 and threads[0].startswith("grammar-compile"), threads


def test_a_messages_text_parts_are_joined_by_newlines(state):
    """As vLLM joins them for a template that reads text: "Translate to French:" and
    "Good morning" ran together as one line."""
    parts = [{"type": "text", "text": "Translate to French:"},
             {"type": "text", "text": "Good morning"}]  # fmt: skip

    def tokens(content) -> list[int]:
        body = {"messages": [{"role": "user", "content": content}]}
        return post(state, "/tokenize", json=body).json()["tokens"]

    assert tokens(parts) == tokens("Translate to French:\nGood morning")
    assert tokens(parts) != tokens("Translate to French:Good morning")


def test_priority_passes_where_the_engines_schedule_by_it(tiny_llama):
    overrides = [f"model={tiny_llama}", "engine.scheduling_policy=priority"]
    state = RouterState.build(load_config(None, overrides))
    chat = [{"role": "user", "content": "x"}]
    for path, body in [
        ("/v1/completions", {"prompt": "x", "priority": -(2**31)}),
        ("/v1/chat/completions", {"messages": chat, "priority": 7}),
        ("/v1/responses", {"input": "x", "priority": 7}),
    ]:  # past validation: placement finds no worker
        assert error_of(post(state, path, json=body), 503)["code"] == "service_unavailable"
    body = {"prompt": "x", "priority": 2**31}
    assert error_of(post(state, "/v1/completions", json=body), 400)["param"] == "priority"
    # An empty salt would hash as none: every unsalted request's blocks, shared.
    for path, body in [
        ("/v1/completions", {"prompt": "x", "cache_salt": ""}),
        ("/v1/chat/completions", {"messages": chat, "cache_salt": ""}),
        ("/v1/embeddings", {"input": "x", "cache_salt": ""}),
        ("/v1/responses", {"input": "x", "cache_salt": ""}),
    ]:
        assert error_of(post(state, path, json=body), 400)["param"] == "cache_salt", path


def test_limits_name_the_prompt_field_and_min_tokens(state):
    max_model_len = state.model.max_model_len
    long_prompt = [5] * max_model_len
    error = error_of(post(state, "/v1/completions", json={"prompt": long_prompt}), 400)
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    scored = {"prompt": long_prompt, "echo": True, "max_tokens": 0, "logprobs": 1}
    error = error_of(post(state, "/v1/completions", json=scored), 400)
    assert f"the prompt resulted in {max_model_len} tokens" in error["message"]
    assert "in the completion" not in error["message"]  # it asked for none
    long_chat = [{"role": "user", "content": "hello " * max_model_len}]
    error = error_of(post(state, "/v1/chat/completions", json={"messages": long_chat}), 400)
    assert (error["param"], error["code"]) == ("messages", "context_length_exceeded")
    assert "the messages resulted in" in error["message"]
    long_input = {"input": "hello " * max_model_len}
    error = error_of(post(state, "/v1/responses", json=long_input), 400)
    assert (error["param"], error["code"]) == ("input", "context_length_exceeded")
    assert "the input resulted in" in error["message"] and "messages" not in error["message"]
    # No max_tokens: min_tokens is checked against what the context leaves.
    chat = {"messages": [{"role": "user", "content": "x"}], "min_tokens": max_model_len}
    error = error_of(post(state, "/v1/chat/completions", json=chat), 400)
    assert error["param"] == "min_tokens" and "context leaves" in error["message"]


def test_token_work_runs_off_the_event_loop(state, monkeypatch):
    """8M ids to /detokenize held the event loop (every stream and health answer) for
    6 s (a security audit): decoding and the id check run on a thread, as /tokenize's
    encoding does, and its token strings too."""
    loop_thread, seen = threading.get_ident(), []
    tokenizer = state.tokenizer
    for name in ("decode", "convert_ids_to_tokens"):
        method = getattr(tokenizer, name)

        def recording(*args, _method=method, **kwargs):
            seen.append(threading.get_ident())
            return _method(*args, **kwargs)

        monkeypatch.setattr(tokenizer, name, recording)
    assert post(state, "/detokenize", json={"tokens": [5, 6]}).status_code == 200
    reply = post(state, "/tokenize", json={"prompt": "hi", "return_token_strs": True})
    assert reply.status_code == 200
    assert len(seen) == 2 and loop_thread not in seen


def test_tokenize_version_and_ping_answer_as_vllm(state):
    reply = post(state, "/tokenize", json={"prompt": "hello world", "return_token_strs": True})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["token_strs"] == state.tokenizer.convert_ids_to_tokens(body["tokens"])
    assert len(body["token_strs"]) == body["count"] > 1
    assert "token_strs" not in post(state, "/tokenize", json={"prompt": "hello"}).json()
    # /detokenize gives the tokenized text back, special tokens (the BOS here) included.
    back = post(state, "/detokenize", json={"tokens": body["tokens"]}).json()["prompt"]
    assert back == state.tokenizer.decode(body["tokens"], skip_special_tokens=False)
    assert back.endswith("hello world") and back != "hello world"
    assert error_of(post(state, "/detokenize", json={"tokens": [10**7]}), 400)["param"] == "tokens"
    version = post(state, "/version", method="GET")
    assert version.status_code == 200 and version.json()["version"]
    health = post(state, "/health", method="GET")
    for method in ("GET", "POST"):  # no worker here: /ping says what /health says
        ping = post(state, "/ping", method=method)
        assert (ping.status_code, ping.json()) == (health.status_code, health.json())


def test_http_errors_use_the_envelope(state):
    assert "GET /v1/nowhere" in error_of(post(state, "/v1/nowhere", method="GET"), 404)["message"]
    reply = post(state, "/v1/completions", method="GET")
    assert error_of(reply, 405) and reply.headers["allow"] == "POST"
    not_utf8 = b'{"prompt": "a\xff\xfe"}'
    headers = {"content-type": "application/json"}
    assert error_of(post(state, "/v1/completions", content=not_utf8, headers=headers), 400)
    deep = b"[" * 5000 + b"]" * 5000
    assert error_of(post(state, "/v1/completions", content=deep, headers=headers), 400)


def test_the_model_card_is_vllms(state, tiny_llama):
    """The fields vLLM's card has (clients of either read them), the base model's root
    its checkpoint."""
    listed = post(state, "/v1/models", method="GET").json()["data"]
    card = post(state, f"/v1/models/{state.model.served_name}", method="GET").json()
    assert [card["id"]] == [entry["id"] for entry in listed]
    assert set(card) == {"id", "object", "created", "owned_by", "root", "parent",
                         "max_model_len", "permission"}  # fmt: skip
    assert (card["root"], card["parent"]) == (str(tiny_llama), None)
    assert card["max_model_len"] == state.model.max_model_len
    (permission,) = card["permission"]
    assert permission["object"] == "model_permission" and permission["allow_sampling"]
    # (an empty name in a body means the base model; an empty id in the path is no model)
    assert error_of(post(state, "/v1/models/", method="GET"), 404)["code"] == "model_not_found"


def test_a_body_that_is_not_json_is_a_415(state):
    """A body not declared JSON (a browser's simple request, curl -d): a 415 saying what to
    send (FastAPI alone answers a 400 about a "dictionary"). Probes take no body."""
    body = jsonlib.dumps({"prompt": "x"}).encode()
    for content_type, named in [("text/plain", "text/plain"), (None, "none"),
                                ("application/x-www-form-urlencoded; charset=utf-8",
                                 "application/x-www-form-urlencoded")]:  # fmt: skip
        headers = {"content-type": content_type} if content_type else {}
        reply = post(state, "/v1/completions", content=body, headers=headers)
        message = error_of(reply, 415)["message"]
        assert "application/json" in message and message.endswith(f"not {named}")
    for content_type in ("application/json; charset=utf-8", "Application/JSON",
                         "application/merge-patch+json"):  # fmt: skip
        reply = post(state, "/v1/completions", content=body, headers={"content-type": content_type})
        assert error_of(reply, 503)  # past validation: no worker
    ping = post(state, "/ping", content=b"x", headers={"content-type": "text/plain"})
    assert ping.status_code != 415
    # A path no POST route serves is a 404 (or a 405 for a GET route's), whatever the body.
    nowhere = post(state, "/v1/responses/resp_1/cancel", content=b"", headers={})
    assert error_of(nowhere, 404)
    assert post(state, "/v1/models", content=b"x", headers={}).status_code == 405
    rejected = [
        line for line in post(state, "/metrics", method="GET").text.splitlines()
        if line.startswith("pdserve:requests_rejected_total") and '"415"' in line
    ]  # fmt: skip
    assert rejected and float(rejected[0].split()[-1]) >= 3


def test_a_body_that_does_not_parse_is_a_400_saying_why(state):
    """JSON that does not parse, no body at all, bytes that are not UTF-8: each a 400 in
    the envelope saying what is wrong (FastAPI said "There was an error parsing the body"
    for the last)."""
    json_type = {"content-type": "application/json"}
    cases = [(b'{"prompt": ', "the body is not valid JSON: Expecting value"),
             (b"", "the request needs a JSON body"),
             (b'{"prompt": "\xff"}', "the body is not valid JSON: not utf-8 text"),
             (b"[1, 2]", "expected an object, got a list"),
             (b'{"max_tokens": 1' + b"0" * 5000 + b"}",  # past int()'s 4,300 digits: a 500
              "the body is not valid JSON: Exceeds the limit (4300 digits)")]  # fmt: skip
    for content, message in cases:
        reply = post(state, "/v1/completions", content=content, headers=json_type)
        assert error_of(reply, 400)["message"].startswith(message), content[:40]


def test_bodies_are_validated_off_the_event_loop(state, monkeypatch):
    """A 7 MB chat of 100k short messages took 2.6 s of pydantic's validation, which
    FastAPI runs on the event loop: every stream and health answer of the router waited.
    Each route's body model is validated on a thread (``router/json_body.py``), but for
    bodies of at most ``INLINE_BYTES`` (queued behind big ones in the shared pool, a tiny
    request waited seconds)."""
    from router.json_body import INLINE_BYTES

    loop_thread, seen = threading.get_ident(), []
    models = (CompletionRequest, ChatCompletionRequest, ResponsesRequest, EmbeddingRequest,
              TokenizeRequest)  # fmt: skip
    for model in models:

        def recording(value, *args, _validate=model.model_validate, _name=model.__name__,
                      **kwargs):  # fmt: skip
            seen.append((_name, threading.get_ident()))
            return _validate(value, *args, **kwargs)

        monkeypatch.setattr(model, "model_validate", recording)
    chat = [{"role": "user", "content": "x"}]
    for path, body in [("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": chat}),
                       ("/v1/responses", {"input": "x"}),
                       ("/v1/embeddings", {"input": "x"}),
                       ("/tokenize", {"prompt": "x"})]:  # fmt: skip
        big = jsonlib.dumps(body) + " " * INLINE_BYTES  # (JSON's whitespace: as large)
        reply = post(state, path, content=big, headers={"content-type": "application/json"})
        assert reply.status_code in (200, 503), path
    names = [name for name, _ in seen]
    assert names == ["CompletionRequest", "ChatCompletionRequest", "ResponsesRequest",
                     "ChatCompletionRequest", "EmbeddingRequest", "TokenizeRequest"]  # fmt: skip
    assert loop_thread not in {thread for _, thread in seen}
    seen.clear()
    assert post(state, "/tokenize", json={"prompt": "x"}).status_code == 200
    assert seen == [("TokenizeRequest", loop_thread)]


def test_openapi_documents_every_request_body(state):
    """Bodies read by ``Body[Model]`` (a dependency) were missing from /openapi.json."""
    document = post(state, "/openapi.json", method="GET").json()
    schemas = document["components"]["schemas"]
    for path, model in [("/v1/completions", "CompletionRequest"),
                        ("/v1/chat/completions", "ChatCompletionRequest"),
                        ("/v1/responses", "ResponsesRequest"), ("/v1/score", "ScoreRequest"),
                        ("/detokenize", "DetokenizeRequest")]:  # fmt: skip
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"] == {"$ref": f"#/components/schemas/{model}"}
    text = jsonlib.dumps(document)
    refs = {ref.split('"', 1)[0] for ref in text.split('"$ref": "#/components/schemas/')[1:]}
    assert refs and refs <= set(schemas)  # none dangling


def test_long_prompts_blocks_are_hashed_off_the_event_loop(state, monkeypatch):
    """Building the choices (or an embedding's sequences) hashes every prompt block (0.24 s
    for 2M ids): past ``THREADED_PROMPT_TOKENS`` on a thread, short ones inline."""
    import router.embeddings as embeddings
    import router.generation_routes as routes
    from router.choices import THREADED_PROMPT_TOKENS

    loop_thread, seen = threading.get_ident(), []
    for module, name in ((routes, "build_choices"), (embeddings, "hash_blocks")):
        call = getattr(module, name)

        def recording(*args, _call=call, **kwargs):
            seen.append(threading.get_ident())
            return _call(*args, **kwargs)

        monkeypatch.setattr(module, name, recording)
    length = state.model.max_model_len // 2
    many = [[5] * length] * (THREADED_PROMPT_TOKENS // length + 1)
    for path, field, prompts, inline in [("/v1/completions", "prompt", many, False),
                                         ("/v1/completions", "prompt", [5, 6], True),
                                         ("/v1/embeddings", "input", many, False),
                                         ("/v1/embeddings", "input", [5, 6], True)]:  # fmt: skip
        before = len(seen)
        body = {field: prompts, **({"max_tokens": 1} if field == "prompt" else {})}
        assert error_of(post(state, path, json=body), 503)  # no worker
        threads = set(seen[before:])
        assert threads and (loop_thread in threads) == inline, (path, inline)


def test_a_tools_format_is_built_off_the_event_loop(state, monkeypatch):
    """ "required" makes one JSON schema of every tool's (each rebased, all dumped): for
    a body of large schemas, that was the event loop's time."""
    import router.generation_routes as routes

    loop_thread, seen = threading.get_ident(), []
    build = routes.tool_format_of

    def recording(*args, **kwargs):
        seen.append(threading.get_ident())
        return build(*args, **kwargs)

    monkeypatch.setattr(routes, "tool_format_of", recording)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [tool],
            "tool_choice": "required"}  # fmt: skip
    assert error_of(post(state, "/v1/chat/completions", json=body), 503)  # no worker
    assert len(seen) == 1 and seen[0] != loop_thread


def test_idle_connections_outlive_the_pools_in_front(state):
    """uvicorn closes an idle connection after 5 s by default: a client (or balancer)
    that sent on it just then got a connection error (1 in 16 at ~5 s idle)."""
    from router.main import _server

    server = _server(state.config, state)
    assert server.config.timeout_keep_alive == state.config.router.keep_alive_s == 75.0
    with pytest.raises(ConfigError, match="keep_alive_s"):
        load_config(None, [f"model={state.config.model}", "router.keep_alive_s=0"])


def test_nesting_past_the_recursion_limit_is_a_400_and_echoes_are_bounded(state, monkeypatch):
    """A JSON schema some 480 levels deep parses, then breaks whatever walks it (a 500
    before; the depth that does so depends on the stack, so the walk is made to fail
    here); a 1 MB model name is not echoed back whole."""

    def too_deep(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded while encoding a JSON object")

    monkeypatch.setattr(state.tokenizer, "encode", too_deep)
    reply = post(state, "/v1/completions", json={"prompt": "x"}, raises=True)
    assert "nested too deeply" in error_of(reply, 400)["message"]  # and nothing raised on
    monkeypatch.undo()
    reply = post(state, "/v1/completions", json={"model": "m" * 1_000_000, "prompt": "x"})
    assert len(error_of(reply, 404)["message"]) < 400


def test_a_huge_prompt_is_refused_before_it_is_tokenized_whole(state):
    """Past a slice (1M characters) a prompt is counted slice by slice and refused as
    soon as it surely exceeds the context; one that asks to be truncated is not. /tokenize
    counts past the context (as vLLM: a client may count a document to cut it), up to
    1M tokens (it tokenized any length: 31 MB grew the router by 4.5 GB)."""
    text = "the quick brown fox jumps over the lazy dog " * 30_000  # 1.3M characters
    for path, body, param in [
        ("/v1/completions", {"prompt": text}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}, "messages"),
    ]:
        error = error_of(post(state, path, json=body), 400)
        assert (error["code"], error["param"]) == ("context_length_exceeded", param)
        assert "resulted in at least" in error["message"]
    truncated = {"prompt": text, "truncate_prompt_tokens": 16}
    assert error_of(post(state, "/v1/completions", json=truncated), 503)  # past: no worker
    limit = state.model.max_model_len
    past_the_context = post(state, "/tokenize", json={"prompt": "fox " * (limit + 1)}).json()
    assert past_the_context["count"] > limit
    huge = text * 4  # ~2.5M tokens
    chat = [{"role": "user", "content": huge}]
    for body, param in [({"prompt": huge}, "prompt"), ({"messages": chat}, "messages")]:
        error = error_of(post(state, "/tokenize", json=body), 400)
        assert error["param"] == param and "/tokenize counts up to 1048576" in error["message"]


def test_a_missing_key_is_a_401_counted_with_the_other_refusals(tiny_llama):
    keyed = RouterState.build(load_config(None, [f"model={tiny_llama}", "router.api_keys=[k]"]))
    assert error_of(post(keyed, "/v1/completions", json={"prompt": "x"}), 401)
    counted = [line for line in post(keyed, "/metrics", method="GET").text.splitlines()
               if line.startswith('pdserve:requests_rejected_total{status="401"}')]  # fmt: skip
    assert counted and float(counted[0].split()[-1]) == 1


def test_a_bug_is_a_500_in_the_envelope_without_details(state, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("secret internals at /srv/x")

    monkeypatch.setattr(state.tokenizer, "encode", broken)
    reply = post(state, "/v1/completions", json={"prompt": "x"})
    error = error_of(reply, 500)
    assert error["code"] == "internal_error" and "secret" not in error["message"]
    # Its id, the one its message and the log name, is its X-Request-Id too (answered
    # outside the middleware that sets it, it had none); past the point where the reply
    # has its id, that id (the header and the message named two).
    assert reply.headers["x-request-id"] in error["message"]
    monkeypatch.undo()
    from router.dispatch import TokenDelta
    from router.formatting import Formatter

    async def generate(request):
        yield TokenDelta(token_ids=[42], finish_reason="length", usage=pb.Usage())

    monkeypatch.setattr(state.dispatcher, "generate", generate)
    monkeypatch.setattr(Formatter, "final", broken)
    late = post(state, "/v1/completions", json={"prompt": "x", "max_tokens": 1})
    late_error = error_of(late, 500)
    assert late.headers["x-request-id"].startswith("cmpl-")
    assert late.headers["x-request-id"] in late_error["message"]


def test_queue_gauges_follow_the_workers_batches(tiny_llama):
    """vLLM's running/waiting gauges (what autoscalers key on): running is what decode
    workers report in their batches, at most this router's open calls there; everything
    else admitted is waiting, including calls queued inside a decode worker (which the
    router's own count of open calls took for running). Per-worker queue and preemption
    gauges come from each worker's Stats."""
    state = RouterState.build(load_config(None, [f"model={tiny_llama}"]))
    reported = {
        Role.DECODE: pb.StatsResponse(num_running=16, num_waiting=40, num_preemptions=3),
        Role.PREFILL: pb.StatsResponse(num_running=2, num_waiting=5),  # before first tokens
    }
    for role, stats in reported.items():
        info = WorkerInfo(worker_id=f"{role}@w", role=role, grpc_address="127.0.0.1:1",
                          events_endpoint="tcp://127.0.0.1:2",
                          replay_endpoint="tcp://127.0.0.1:3")  # fmt: skip
        worker = WorkerState(info, None, None, None, None, stats=stats, healthy=True)
        worker.num_running = 56  # open Generate calls: the 16 running and the 40 queued
        state.pool.workers[info.worker_id] = worker

    def scrape() -> dict[tuple[str, str], float]:
        reply = post(state, "/metrics", method="GET")
        return {
            (sample.name, sample.labels.get("worker", "")): sample.value
            for family in text_string_to_metric_families(reply.text)
            for sample in family.samples
        }

    state.num_inflight = 60
    values = scrape()
    assert values["vllm:num_requests_running", ""] == 16
    assert values["vllm:num_requests_waiting", ""] == 44
    assert values["pdserve:worker_requests_waiting", "decode@w"] == 40
    assert values["pdserve:worker_preemptions", "decode@w"] == 3
    # The workers also serve another router's requests; of this router's 10, 4 have
    # reached the decode worker and 6 wait in its gate or in prefill.
    state.num_inflight = 10
    state.pool.workers[f"{Role.DECODE}@w"].num_running = 4
    values = scrape()
    assert (values["vllm:num_requests_running", ""], values["vllm:num_requests_waiting", ""]) == (
        4, 6,
    )  # fmt: skip


def test_embeddings_refusals_name_their_field_and_valid_ones_reach_placement(state):
    """``/v1/embeddings``: what OpenAI and vLLM refuse is a 400 naming the field; a valid
    request (text, token ids, a batch, truncated) reaches placement: here a 503."""
    max_model_len = state.model.max_model_len
    vocab = state.tokenizer.vocab_size
    cases = [
        ({"input": ""}, "input", "must not be empty"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": ["a", ""]}, "input", "must not be empty"),
        ({"input": [[5, 6], []]}, "input", "must not be empty"),
        ({"input": "x", "dimensions": 8}, "dimensions", "not supported"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", "float"),
        ({"input": [vocab]}, "input", "must be in"),
        ({"input": ["x"] * 2049}, "input", "at most 2048"),
        ({"input": [5] * (max_model_len + 1)}, "input", "the input resulted in"),
        ({"input": "hello " * max_model_len}, "input", "the input resulted in"),
        ({"input": "x", "priority": 2}, "priority", "scheduling_policy"),
        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", ">= 1"),
        ({"input": "x", "embed_dtype": "float16"}, "embed_dtype", "not supported"),
        ({"input": "x", "endianness": "big"}, "endianness", "not supported"),
        ({"input": ["1", 2]}, "input", ""),  # strict: not the ids 1 and 2
        ({"input": [True, False]}, "input", ""),
        ({"input": [[1.0, 2.0]]}, "input", ""),
        ({"input": ["hello " * 400] * 3 + ["hello " * max_model_len] * 500}, "input",
         "the input resulted in"),  # at the first long one, not after encoding 500
    ]  # fmt: skip
    for body, param, words in cases:
        error = error_of(post(state, "/v1/embeddings", json=body), 400)
        assert error["param"] == param and words in error["message"], (body, error)
    error = error_of(post(state, "/v1/embeddings", json={"input": "x", "model": "gpt-17"}), 404)
    assert error["code"] == "model_not_found"
    for body in [
        {"input": "x"},
        {"input": "x", "model": ""},  # no model configured in the client: the base model
        {"input": ["a", "b"], "encoding_format": "base64", "model": state.model.served_name},
        {"input": [5, 6, 7]},
        {"input": [[5, 6, 7], [8]], "normalize": False, "dimensions": None},
        {"input": "x", "embed_dtype": "float32", "endianness": "little"},
        # More inputs than sequences run at once: they run some at a time.
        {"input": ["x"] * 2048},
        {"input": [5] * (max_model_len + 9), "truncate_prompt_tokens": -1},
    ]:
        error = error_of(post(state, "/v1/embeddings", json=body), 503)
        assert error["code"] == "service_unavailable", body
    assert state.num_inflight == 0


def test_score_and_rerank_refusals_name_their_field_and_valid_ones_reach_placement(state):
    """``/v1/score`` and ``/v1/rerank`` (and their aliases): a 400 naming the field for
    what cannot be scored; valid requests reach placement (a 503 here)."""
    max_model_len = state.model.max_model_len
    long = "hello " * max_model_len
    cases = [
        ("/v1/score", {"text_1": "", "text_2": "a"}, "text_1", "must not be empty"),
        ("/v1/score", {"text_1": "q", "text_2": []}, "text_2", "must not be empty"),
        ("/v1/score", {"text_1": "q", "text_2": ["a", ""]}, "text_2", "must not be empty"),
        ("/v1/score", {"text_1": ["q", "r"], "text_2": ["a"] * 3}, "text_2", "text_1 holds 2"),
        ("/v1/score", {"text_1": "q", "text_2": ["a"] * 2049}, "text_2", "at most 2048"),
        ("/v1/score", {"text_1": "q", "text_2": [1, 2]}, "text_2", ""),  # texts only
        ("/v1/score", {"text_1": "q", "text_2": long}, "text_2", "resulted in 12290"),
        ("/score", {"text_1": "q", "text_2": "a", "priority": 1}, "priority", "scheduling"),
        # vLLM's other namings of the two sides: errors name the fields sent.
        ("/v1/score", {"queries": "q", "documents": [""]}, "documents", "must not be empty"),
        ("/v1/score", {"queries": ["q", "r"], "items": ["a"] * 3}, "items", "queries holds 2"),
        ("/v1/score", {"data_1": "q", "data_2": ["a"] * 2049}, "data_2", "at most 2048"),
        ("/v1/score", {"data_1": [long, "q"], "data_2": ["a", "b"]}, "data_1", "resulted in"),
        ("/v1/score", {"queries": "q"}, "documents", "documents is required with queries"),
        ("/v1/score", {"items": ["a"]}, "queries", "queries is required with items"),
        ("/v1/score", {"text_2": ["a"]}, "text_1", "text_1 is required with text_2"),
        ("/v1/score", {}, "text_1", "queries and documents"),
        ("/v1/score", {"text_1": "q", "documents": ["a"]}, "documents", "under one naming"),
        ("/v1/score", {"queries": "q", "documents": ["a"], "items": ["b"]}, "items",
         "under one naming"),
        ("/v1/score", {"text_1": "q", "text_2": ["a"], "data_2": ["b"]}, "data_2",
         "under one naming"),
        ("/v1/rerank", {"query": "q", "documents": []}, "documents", "must not be empty"),
        ("/v1/rerank", {"query": "", "documents": ["a"]}, "query", "must not be empty"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n", ""),
        ("/rerank", {"query": "q", "documents": "a"}, "documents", ""),
        ("/v2/rerank", {"query": "q", "documents": ["a"], "truncate_prompt_tokens": 0},
         "truncate_prompt_tokens", ">= 1"),
        ("/v1/rerank", {"query": "q", "documents": [{"text": ""}]}, "documents", "empty"),
        ("/v1/rerank", {"query": "q", "documents": [{"txt": "a"}]}, "documents", ""),
        # The query's own length is checked first, and blamed on its field.
        ("/v1/rerank", {"query": long, "documents": ["a"]}, "query", "resulted in"),
        ("/v1/score", {"text_1": [long, "q"], "text_2": ["a", "b"]}, "text_1", "resulted in"),
        # What vLLM and Cohere honour and pdserve does not: refused, not ignored.
        ("/v1/score", {"text_1": "q", "text_2": "a", "use_activation": False},
         "use_activation", "not supported"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "label_token_ids": [1, 2]},
         "label_token_ids", "not supported"),
        ("/v2/rerank", {"query": "q", "documents": ["a"], "max_tokens_per_doc": 512},
         "max_tokens_per_doc", "not supported"),
    ]  # fmt: skip
    for path, body, param, words in cases:
        error = error_of(post(state, path, json=body), 400)
        assert error["param"] == param and words in error["message"], (path, body, error)
    error = error_of(post(state, "/v1/rerank", json={"query": "q", "documents": ["a"],
                                                     "model": "gpt-17"}), 404)  # fmt: skip
    assert error["code"] == "model_not_found"
    for path, body in [
        ("/v1/score", {"text_1": "q", "text_2": ["a", "b"]}),
        ("/score", {"text_1": ["q", "r"], "text_2": ["a", "b"], "cache_salt": "s"}),
        ("/v1/score", {"queries": "q", "documents": ["a", "b"]}),
        ("/v1/score", {"queries": ["q", "r"], "items": ["a", "b"]}),
        ("/score", {"data_1": "q", "data_2": "a", "text_1": None}),
        ("/v1/rerank", {"query": "q", "documents": ["a"] * 2048, "top_n": 3}),
        ("/v2/rerank", {"query": "q", "documents": [long], "truncate_prompt_tokens": -1}),
        ("/rerank", {"query": "q", "documents": [{"text": "a"}, "b"], "use_activation": True}),
    ]:
        error = error_of(post(state, path, json=body), 503)
        assert error["code"] == "service_unavailable", body
    assert state.num_inflight == 0


def test_a_request_that_ran_is_traced_from_its_arrival_and_a_refused_one_is_not(tiny_llama):
    """With tracing on: a request that passed validation and admission has a span from
    its arrival, with its status where it failed (here 503: no worker), and a 5xx is a
    failure; a 400 makes no span (the metrics count refusals)."""
    from tests.support.otlp_receiver import otlp_receiver

    with otlp_receiver() as receiver:
        traced = RouterState.build(load_config(None, [
            f"model={tiny_llama}", f"tracing.otlp_traces_endpoint={receiver.url}"]))  # fmt: skip
        before = time.time_ns()
        error_of(post(traced, "/v1/completions", json={"prompt": "x"}), 503)
        error_of(post(traced, "/v1/completions", json={"prompt": "x", "n": 0}), 400)
        error_of(post(traced, "/v1/embeddings", json={"input": ["a", "b"]}), 503)
        traced.tracer.shutdown()
        spans = receiver.wait_for(lambda spans: len(spans) >= 2, 5)
    assert sorted(span.name for span in spans) == ["POST /v1/completions", "POST /v1/embeddings"]
    for span in spans:
        assert span.failed and span.attributes["http.response.status_code"] == 503
        assert span.parent_span_id == "" and before <= span.start_ns <= span.end_ns
    assert traced.num_inflight == 0


def test_a_client_gone_while_its_prompt_was_tokenized_gets_nothing_run(state):
    """A client that left before its request was admitted (while its prompt or texts
    were tokenized) gets a 499 and nothing placed: without the check the request reached
    placement (here a 503) and ran until the next disconnect poll."""
    chat = [{"role": "user", "content": "x"}]
    for path, body in [("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": chat}),
                       ("/v1/responses", {"input": "x"}),
                       ("/v1/embeddings", {"input": ["a", "b"]}),
                       ("/v1/rerank", {"query": "q", "documents": ["a", "b"]})]:  # fmt: skip
        statuses = []

        async def leave(path=path, body=body, statuses=statuses) -> None:
            messages = [{"type": "http.request", "body": jsonlib.dumps(body).encode()}]

            async def receive() -> dict:
                return messages.pop(0) if messages else {"type": "http.disconnect"}

            async def send(message: dict) -> None:
                if message["type"] == "http.response.start":
                    statuses.append(message["status"])

            scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                     "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
                     "query_string": b"", "root_path": "", "server": ("router", 80),
                     "client": ("127.0.0.1", 5), "headers": [
                         (b"content-type", b"application/json"), (b"host", b"[::1]")]}  # fmt: skip
            await create_app(state)(scope, receive, send)

        asyncio.run(leave())
        assert statuses == [499], (path, statuses)
    assert state.num_inflight == 0


def test_a_checkpoint_that_pools_otherwise_gets_no_last_token_embeddings(tiny_llama, tmp_path):
    """A sentence-transformers checkpoint that pools by the mean of its tokens got the
    last token's vector, silently (an audit: off by 0.27): its embeddings are refused,
    and token-logits scoring, which pools nothing, still passes that check."""
    model_dir = tmp_path / "mean-pooled"
    model_dir.mkdir()
    for path in tiny_llama.iterdir():
        (model_dir / path.name).symlink_to(path)
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]  # fmt: skip
    (model_dir / "modules.json").write_text(jsonlib.dumps(modules))
    (model_dir / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True,
               "pooling_mode_lasttoken": False, "pooling_mode_cls_token": False}  # fmt: skip
    (model_dir / "1_Pooling" / "config.json").write_text(jsonlib.dumps(pooling))
    mean = RouterState.build(load_config(None, [f"model={model_dir}"]))
    assert mean.model.pooling_modes == ("mean_tokens",)
    for path, body in [("/v1/embeddings", {"input": "x"}),
                       ("/v1/rerank", {"query": "q", "documents": ["a"]})]:  # fmt: skip
        error = error_of(post(mean, path, json=body), 400)
        assert "pools by mean_tokens" in error["message"] and error["param"] == "model"
    pooling.update(pooling_mode_mean_tokens=False, pooling_mode_lasttoken=True)
    (model_dir / "1_Pooling" / "config.json").write_text(jsonlib.dumps(pooling))
    last = RouterState.build(load_config(None, [f"model={model_dir}"]))
    assert last.model.foreign_pooling is None
    assert post(last, "/v1/embeddings", json={"input": "x"}).status_code == 503  # (no worker)
    # A Dense projection after pooling changes the vector too (a review).
    modules.append({"idx": 2, "name": "2", "path": "2_Dense",
                    "type": "sentence_transformers.models.Dense"})  # fmt: skip
    (model_dir / "modules.json").write_text(jsonlib.dumps(modules))
    dense = RouterState.build(load_config(None, [f"model={model_dir}"]))
    error = error_of(post(dense, "/v1/embeddings", json={"input": "x"}), 400)
    assert "runs Dense after pooling" in error["message"]


def test_every_response_carries_a_request_id(state):
    """OpenAI sends ``X-Request-Id`` (the SDK's ``_request_id``, and in its errors): the
    client's own when it sent a plain one, else the response's id (which a 500's message
    and the log name), else a fresh one; refusals included."""
    chat = {"messages": [{"role": "user", "content": "x"}]}
    placed = post(state, "/v1/chat/completions", json=chat)  # 503 once placed: no worker
    assert placed.status_code == 503 and placed.headers["x-request-id"].startswith("chatcmpl-")
    refused = post(state, "/v1/chat/completions", json={"messages": []})
    assert refused.status_code == 400 and refused.headers["x-request-id"].startswith("req-")
    assert (
        refused.headers["x-request-id"]
        != post(state, "/v1/models", method="GET").headers["x-request-id"]
    )
    given = post(state, "/v1/chat/completions", json=chat, headers={"x-request-id": "trace-7"})
    assert given.headers["x-request-id"] == "trace-7"
    odd = post(state, "/v1/chat/completions", json=chat, headers={"x-request-id": "a b\\x"})
    assert odd.headers["x-request-id"].startswith("chatcmpl-")  # not echoed as sent


def test_a_reply_with_scores_is_built_and_encoded_off_the_event_loop(state, monkeypatch):
    """A 100k-token prompt's top-20 ``prompt_logprobs`` held the event loop (every other
    stream and health answer) 5.4 s: the body is built on a thread and encoded a slice
    at a time (one json.dumps of it holds the GIL throughout)."""
    from router.dispatch import TokenDelta
    from router.formatting import Formatter

    prompt = list(range(5, 45))
    scores = [pb.TokenLogprobs(token_id=t, logprob=-1.5, rank=2, top_token_ids=[7, 8],
                               top_logprobs=[-0.5, -1.0]) for t in prompt[1:]]  # fmt: skip

    async def generate(request):
        yield TokenDelta(token_ids=[42], finish_reason="length", prompt_logprobs=scores,
                         cached_tokens=0, usage=pb.Usage(prompt_tokens=len(prompt),
                                                         completion_tokens=1))  # fmt: skip

    loop_thread, seen = threading.get_ident(), []
    final = Formatter.final

    def recording(self, choices):
        seen.append(threading.get_ident())
        return final(self, choices)

    monkeypatch.setattr(state.dispatcher, "generate", generate)
    monkeypatch.setattr(Formatter, "final", recording)
    body = {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2}
    reply = post(state, "/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    scored = reply.json()["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(prompt)
    assert scored[1]["6"]["logprob"] == -1.5 and scored[1]["7"]["rank"] == 1
    assert len(seen) == 1 and seen[0] != loop_thread
    plain = post(state, "/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert plain.status_code == 200 and seen[-1] == loop_thread  # (small: no thread hop)
    # /v1/responses builds its own object there too (it parsed and re-encoded the chat
    # reply on the loop: 1.2 s for 16k tokens' top 20).
    from router.response_output import ResponseShape

    resolve, resolved = ResponseShape.resolved, []

    def recording_resolve(self, reply):
        resolved.append(threading.get_ident())
        return resolve(self, reply)

    monkeypatch.setattr(ResponseShape, "resolved", recording_resolve)
    asked = {"input": "hi", "top_logprobs": 2, "include": ["message.output_text.logprobs"]}
    response = post(state, "/v1/responses", json=asked)
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "response"
    assert len(resolved) == 1 and resolved[0] != loop_thread


def test_a_request_that_began_before_the_drain_is_refused_at_admission(state, monkeypatch):
    """It passed the draining check, then awaited (its grammar compiling) while the drain
    began: admission refuses it with a 503 in the envelope (it was let in uncounted, and
    the drain stopped the server under it). /health says draining with Retry-After, as
    new requests get it."""
    import router.generation_routes as routes

    check = routes.check_constraint

    def drain_meanwhile(*args):
        state.draining = True
        return check(*args)

    monkeypatch.setattr(routes, "check_constraint", drain_meanwhile)
    try:
        reply = post(state, "/v1/completions", json={"prompt": "x", "guided_regex": "[ab]+"})
        health = post(state, "/health", method="GET")
    finally:
        state.draining = False
    assert error_of(reply, 503)["code"] == "service_unavailable"
    assert "draining" in reply.json()["error"]["message"] and reply.headers["retry-after"]
    assert state.num_inflight == 0
    assert health.status_code == 503 and health.headers["retry-after"] == "1"


def test_a_reply_still_waiting_when_the_drain_grace_ends_is_a_503(state, monkeypatch):
    """A reply waiting for its first event (queued for a decode slot, a long prefill)
    at the end of the drain's grace got uvicorn's plain-text 500 at the server's close:
    a 503 in the envelope with Retry-After now."""

    async def never(request):
        await asyncio.sleep(60)
        yield  # (a generator that yields nothing)

    async def stop_soon() -> httpx.Response:
        async def stop() -> None:
            await asyncio.sleep(0.2)
            state.stopping = True

        transport = httpx.ASGITransport(create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            stopping = asyncio.create_task(stop())
            body = {"prompt": "x", "max_tokens": 2}
            reply = await asyncio.wait_for(client.post("/v1/completions", json=body), 10)
            await stopping
            return reply

    monkeypatch.setattr(state.dispatcher, "generate", never)
    try:
        reply = asyncio.run(stop_soon())
    finally:
        state.stopping = False
    assert error_of(reply, 503)["code"] == "service_unavailable"
    assert reply.headers["retry-after"] and "stopped" in reply.json()["error"]["message"]


def test_a_keyless_loopback_router_answers_loopback_host_names_only(state, tiny_llama):
    """DNS rebinding: a page on another site points its own name at 127.0.0.1 and its
    browser's requests reach the router as same-origin, with that name as ``Host``
    (a keyless router ran them). Loopback names and ``router.allowed_hosts`` pass; a
    router with keys, or on another address, takes any ``Host``."""
    models = {"method": "GET"}
    error = error_of(post(state, "/v1/models", headers={"host": "evil.example:8000"}, **models),
                     400)  # fmt: skip
    assert "'evil.example'" in error["message"] and "router.allowed_hosts" in error["message"]
    assert error_of(post(state, "/health", headers={"host": "evil.example"}, **models), 400)
    assert error_of(post(state, "/health", headers={"host": "[::1]evil.example"}, **models), 400)
    for host in ("localhost:8000", "LOCALHOST", "localhost.", "127.0.0.2:80", "[::1]:8000"):
        assert post(state, "/v1/models", headers={"host": host}, **models).status_code == 200
    for overrides, headers in (
        (["router.allowed_hosts=[api.example.com]"], {"host": "API.example.com:443"}),
        (["router.allowed_hosts=['*']"], {"host": "evil.example"}),
        (["router.api_keys=[k]"], {"host": "evil.example", "authorization": "Bearer k"}),
        (["router.host=0.0.0.0"], {"host": "evil.example"}),
    ):
        other = RouterState.build(load_config(None, [f"model={tiny_llama}", *overrides]))
        assert post(other, "/v1/models", headers=headers, **models).status_code == 200
    with pytest.raises(ConfigError, match="router.allowed_hosts: 'https://a.example'"):
        load_config(None, ["router.allowed_hosts=['https://a.example']"])
