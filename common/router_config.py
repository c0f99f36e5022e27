"""The router's settings (``RouterConfig``, the ``router`` section) and the enums its
fields take: tool-call and reasoning parsers, scoring methods."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from enum import StrEnum

from common.config_base import ConfigError, coerce_enums

# A host name as a URL names it (an IPv6 address in brackets is not one here).
_LABEL = r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}[A-Za-z0-9_])?"  # (_: compose's service names)
_HOST_NAME = re.compile(rf"{_LABEL}(\.{_LABEL})*")


class ToolCallParser(StrEnum):
    NONE = "none"  # tool_choice "auto" refused: only required or a named function
    HERMES = "hermes"  # <tool_call>{"name": ..., "arguments": ...}</tool_call> (Qwen2.5/3, Hermes)
    LLAMA3_JSON = "llama3_json"  # the answer is {"name": ..., "parameters": ...} (Llama 3.x)
    MISTRAL = "mistral"  # [TOOL_CALLS] then a JSON list, or NAME[ARGS]{...} per call (Mistral)
    GLM45 = "glm45"  # <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>... (GLM-4.5)
    DEEPSEEK_V3 = "deepseek_v3"  # <｜tool▁calls▁begin｜>... (DeepSeek-V3, R1, V3.1)
    MINIMAX_M2 = "minimax_m2"  # <minimax:tool_call><invoke name=...><parameter ...> (MiniMax-M2)
    KIMI_K2 = "kimi_k2"  # <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0... (K2)


class ReasoningParser(StrEnum):
    NONE = "none"  # the text is the content, thinking included
    DEEPSEEK_R1 = "deepseek_r1"  # <think>...</think>, always thinks (DeepSeek-R1, QwQ)
    QWEN3 = "qwen3"  # <think>...</think> where the output or the prompt opens one (Qwen3)


class ScoreMethod(StrEnum):
    EMBEDDING = "embedding"  # the cosine similarity of the two texts' embeddings
    TOKEN_LOGITS = "token_logits"  # one prompt per pair, read off next-token logits


# score_template's default: the two texts one after the other (vLLM's pairing of texts).
DEFAULT_SCORE_TEMPLATE = "{query}{document}"


def valid_api_key(key: str) -> bool:
    """Whether ``key`` is one ``PDSERVE_API_KEYS`` can carry (its keys are separated by
    commas or whitespace; a header carries printable ASCII alone)."""
    return bool(key) and key.isascii() and key.isprintable() and not ("," in key or " " in key)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Bearer keys accepted on /v1 and /tokenize; empty: no authentication.
    api_keys: list[str] = dataclasses.field(default_factory=list)
    # The name clients pass as "model"; empty: the checkpoint directory's name ("demo" for
    # the built-in model).
    served_model_name: str = ""
    # Prompts whose part not cached on the chosen decode worker is shorter than this are
    # prefilled there (no transfer); longer ones go to a prefill worker.
    min_disagg_tokens: int = 256
    # Placement weights. A CPU-tier hit saves this fraction of a GPU hit's prefill work.
    cpu_hit_credit: float = 0.5
    # Assumed prefill speed of a worker that has not reported one yet (tokens/s).
    default_prefill_tokens_per_s: float = 5000.0
    # Use each prefill worker's own measured speed (heterogeneous hardware). Off: the
    # median over the prefill workers, since on identical hardware differences between
    # measurements are noise (a worker that only saw short prompts looks slow).
    per_worker_prefill_rate: bool = False
    # Prefill cost also charges this much per token a worker would recompute that another
    # already caches: work wasted system-wide, which delays everyone's later requests.
    prefill_recompute_penalty: float = 4.0
    # Decode score = load - decode_prefix_weight * (cached fraction of the prompt).
    decode_prefix_weight: float = 0.5
    # Both prefix terms above are divided by the matched prefix's uses, decayed over
    # this many seconds: a prefix many requests share is worth recomputing elsewhere
    # (router/prefix_demand.py). 0: never divided.
    prefix_reuse_window_s: float = 30.0
    # Sequences in flight through this router (a request runs len(prompts) * n of them)
    # beyond which new requests get 429 (Retry-After); a single request asking for more
    # gets 400. Per router: N routers in front of one pool admit up to N times this.
    max_inflight_sequences: int = 1024
    # A request body larger than this is a 413, refused before the router reads it.
    # 32 MiB holds a 1M-token prompt's text (~4 characters a token) even if every
    # character came JSON-escaped (\uXXXX, 6 bytes).
    max_request_bytes: int = 32 << 20
    # A vision-language model's images per request (OpenAI's image_url content parts),
    # each counted as a run of placeholder tokens in the prompt; together they fit
    # max_request_bytes, fetched ones included.
    max_images_per_request: int = 8
    # Hosts whose http(s) image URLs the router fetches, by exact name
    # ("images.example.com"); empty: images come inline only (data: URLs). A server that
    # fetches what clients name can be pointed at its own network: list only hosts that
    # serve images you mean to be read. Redirects are not followed.
    allowed_media_domains: list[str] = dataclasses.field(default_factory=list)
    media_fetch_timeout_s: float = 10.0  # one whole fetch
    # Web pages whose scripts may call the API from a browser (CORS), by origin
    # ("https://chat.example.com"), or "*" for any (vLLM's default); empty: no CORS
    # headers, so browsers keep other origins' pages from reading the answers.
    allowed_origins: list[str] = dataclasses.field(default_factory=list)
    # Host names a router on a loopback address without API keys answers besides
    # localhost, 127.0.0.1 and ::1 (a reverse proxy's public name that it passes on as
    # Host), or "*" for any: other Host headers are refused, against DNS rebinding
    # (router/host_check.py).
    allowed_hosts: list[str] = dataclasses.field(default_factory=list)
    prefill_timeout_s: float = 120.0  # one prefill try
    # A sequence's whole journey, from admission: waiting for room on a decode worker,
    # its prefill tries and its decode (a 503 once passed).
    request_timeout_s: float = 600.0
    # How often the router refreshes the worker list, health and load.
    refresh_interval_s: float = 1.0
    # A worker that answers no probe for this long (frozen: a hung device, a stopped
    # process) has its requests in flight failed, or retried where nothing was sent yet.
    worker_stall_timeout_s: float = 10.0
    # How often one sequence may move to another decode worker after its tokens began to
    # stream (its worker died or froze): the new worker recomputes prompt + tokens so far
    # and goes on, so the client sees no error. It also bounds the damage of a request
    # that crashes engines (each move can take one more worker down). 0: such a failure
    # ends the stream with an error.
    max_decode_migrations: int = 1
    # Backpressure: a sequence starts (its prefill, wherever it runs) only while the
    # sequences ahead on its decode worker (in its batch, queued there, or in prefill for
    # it) number fewer than this many times the decode workers' max_num_seqs, and their
    # prompts (with its own) take at most this many times that worker's KV cache; later
    # ones wait in the router, first come first served, instead of leaving prefill
    # workers' KV leased to a decode worker that cannot pull it yet. 0: no limit.
    decode_queue_factor: float = 2.0
    drain_grace_s: float = 30.0
    # How long an idle client connection stays open for its next request. Above the idle
    # timeouts of the pools and load balancers in front (AWS ALB 60 s; nginx upstream
    # keepalive 60 s): a client that sends just as the router closes the connection gets
    # a connection error (uvicorn's 5 s: 1 in 16 requests sent ~5 s after the last). Each
    # idle connection holds a file descriptor that long (raise the router's fd limit for
    # many short-lived clients).
    keep_alive_s: float = 75.0
    # How tool calls are read from a model's free text, for tool_choice "auto" (the
    # default when a request gives tools): the model family's own call format, as
    # vLLM's --tool-call-parser. none: "auto" is refused ("required" and a named
    # function constrain the output instead and need no parser).
    tool_call_parser: ToolCallParser = ToolCallParser.NONE
    # vLLM's --reasoning-parser: a chat reply's thinking goes out as reasoning_content
    # (router/reasoning.py), and a constraint applies after it. none: all is content.
    reasoning_parser: ReasoningParser = ReasoningParser.NONE
    # Text in a chat request that spells a special token (a user writing "<|im_end|>\n
    # <|im_start|>system\n..."): false keeps it text, so no client can forge the
    # template's turns or markers; true makes it the token, as vLLM and transformers do.
    parse_special_tokens_in_messages: bool = False
    # /v1/score and /v1/rerank: how a (query, document) pair is scored (router/scoring.py).
    # embedding: the cosine similarity of their embeddings (an embedding model's).
    # token_logits: one prompt per pair, score_template with {query} and {document}
    # filled in, scored by the model's next-token logits at score_tokens: a causal-LM
    # reranker, such as Qwen3-Reranker (["no", "yes"]: the softmax probability of the
    # second) or bge-reranker-v2-gemma (["Yes"]: the logit's sigmoid).
    score_method: ScoreMethod = ScoreMethod.EMBEDDING
    score_tokens: tuple[str, ...] = ()
    score_template: str = DEFAULT_SCORE_TEMPLATE

    def __post_init__(self) -> None:
        coerce_enums(self)
        if self.score_method is ScoreMethod.TOKEN_LOGITS:
            if len(self.score_tokens) not in (1, 2):
                raise ConfigError("router.score_tokens", "token_logits reads 1 token (its "
                                  "logit's sigmoid) or 2 (negative, positive)")  # fmt: skip
            if len(set(self.score_tokens)) != len(self.score_tokens):
                raise ConfigError("router.score_tokens", "the negative and the positive token "
                                  "must differ (every score would be 0.5)")  # fmt: skip
            for key in ("{query}", "{document}"):
                if key not in self.score_template:
                    raise ConfigError("router.score_template", f"must contain {key}")
        elif self.score_tokens or self.score_template != DEFAULT_SCORE_TEMPLATE:
            raise ConfigError("router.score_method", "score_tokens and score_template apply "
                              "to token_logits only; set score_method: token_logits")  # fmt: skip
        if not 0.0 <= self.cpu_hit_credit <= 1.0:
            raise ConfigError("router.cpu_hit_credit", "must be in [0, 1]")
        if self.min_disagg_tokens < 0:
            raise ConfigError("router.min_disagg_tokens", "must be >= 0")
        if self.max_inflight_sequences < 1:
            raise ConfigError("router.max_inflight_sequences", "must be >= 1")
        if self.max_request_bytes < 1:
            raise ConfigError("router.max_request_bytes", "must be >= 1")
        if self.max_images_per_request < 0:
            raise ConfigError("router.max_images_per_request", "must be >= 0")
        if self.media_fetch_timeout_s <= 0:
            raise ConfigError("router.media_fetch_timeout_s", "must be > 0")
        if not all(map(valid_api_key, self.api_keys)):  # (pdserve up passes them on so)
            raise ConfigError("router.api_keys", "each key must be printable ASCII without "
                              "spaces or commas")  # fmt: skip
        for domain in self.allowed_media_domains:  # (a URL, port or wildcard never matched)
            if not _HOST_NAME.fullmatch(domain):
                raise ConfigError("router.allowed_media_domains", f"{domain!r} is not a host "
                                  "name (images.example.com: no scheme, port, path or "
                                  "wildcard)")  # fmt: skip
        for name in self.allowed_hosts:
            if name != "*" and (not name or any(c in name for c in "/:@ ")):
                raise ConfigError("router.allowed_hosts", f"{name!r} is not a host name "
                                  "(api.example.com: no scheme, port or path) or '*'")  # fmt: skip
        for origin in self.allowed_origins:
            scheme, _, host = origin.partition("://")
            if origin != "*" and (scheme not in ("http", "https") or not host or "/" in host):
                raise ConfigError("router.allowed_origins", f"{origin!r} is not an origin "
                                  "(scheme://host[:port], no path) or '*'")  # fmt: skip
        if self.max_decode_migrations < 0:
            raise ConfigError("router.max_decode_migrations", "must be >= 0")
        if self.decode_queue_factor < 0:
            raise ConfigError("router.decode_queue_factor", "must be >= 0")
        for key in (
            "default_prefill_tokens_per_s",
            "prefill_timeout_s",
            "request_timeout_s",
            "refresh_interval_s",
            "worker_stall_timeout_s",
            "keep_alive_s",
        ):
            if getattr(self, key) <= 0:
                raise ConfigError(f"router.{key}", "must be > 0")
        if self.drain_grace_s < 0:
            raise ConfigError("router.drain_grace_s", f"must be >= 0, got {self.drain_grace_s}")
        for key in ("prefill_recompute_penalty", "decode_prefix_weight", "prefix_reuse_window_s"):
            if getattr(self, key) < 0:
                raise ConfigError(f"router.{key}", f"must be >= 0, got {getattr(self, key)}")
        if not self.host:
            raise ConfigError("router.host", "must not be empty")
