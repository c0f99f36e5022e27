"""Everything one router process holds, built once from the config at start-up."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from common.config import PdserveConfig, Role, TracingConfig
from common.engine_config import SchedulingPolicy
from common.generation_config import GenerationDefaults
from common.internal_auth import NO_AUTH, InternalAuth
from common.model_info import ModelInfo, model_info
from common.multimodal import ImageText
from common.registry import create_registry
from common.router_config import ToolCallParser
from common.structured_output import GrammarCompiler, StructuredOutput, StructuredOutputError
from common.tokenizer import Tokenizer
from common.tracing import Tracer
from proto import pdserve_pb2 as pb
from router.dispatch import Dispatcher
from router.events import EventListener
from router.harmony import marker_ids
from router.images import image_text_of
from router.live_plan import LivePlan
from router.lora_adapters import LoraAdapters
from router.metrics import RouterMetrics
from router.policy import PlacementPolicy
from router.prefix_index import PrefixIndex
from router.scoring import EMBEDDING_SCORER, Scorer
from router.tool_parsers import (
    DEEPSEEK_MARKERS,
    HERMES_MARKERS,
    KIMI_MARKERS,
    MINIMAX_MARKERS,
    MISTRAL_MARKERS,
)
from router.workers import WorkerPool

logger = logging.getLogger(__name__)

ROUTER_SERVICE = "pdserve-router"  # the router's service.name in traces


class _Pool(WorkerPool):
    def candidates_for_health(self) -> list:
        return self.candidates(Role.DECODE)


def router_instance(config: PdserveConfig) -> str:
    """This router's name in traces: its host's name (a pod's, under Kubernetes) and port,
    as its listening address may be 0.0.0.0 on every replica."""
    return f"router@{socket.gethostname()}:{config.router.port}"


@dataclass
class RouterState:
    config: PdserveConfig
    model: ModelInfo
    tokenizer: Tokenizer
    index: PrefixIndex
    index_lock: threading.Lock
    events: EventListener
    pool: _Pool
    metrics: RouterMetrics
    dispatcher: Dispatcher
    adapters: LoraAdapters
    started_at: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    # The drain's grace ended with replies still running: each ends at its next event,
    # a stream with an error event and [DONE], a whole reply as a 503 with Retry-After
    # (the server's close cut them: a transport error, httpx's "incomplete chunked
    # read", that a client cannot tell from a network fault).
    stopping: bool = False
    num_inflight: int = 0  # sequences admitted and not yet ended (see admission.Admission.admit)
    num_open_requests: int = 0  # HTTP requests being answered (``router/app.py``)
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    # The Harmony markers' token ids, where the model writes its chat replies in that
    # format (GPT-OSS; router/harmony.py); None: it does not.
    harmony_ids: frozenset[int] | None = None
    # The tool-call parser's markers that are special tokens, which decoding would drop
    # (Mistral's [TOOL_CALLS]; router/tool_parsers.py).
    tool_marker_ids: frozenset[int] = frozenset()
    # How prompts hold a vision-language model's images (router/images.py); None: no images.
    image_text: ImageText | None = None
    # How /v1/score and /v1/rerank score a pair (router/scoring.py).
    scorer: Scorer = EMBEDDING_SCORER
    # Spans of the requests that run (common/tracing.py); off unless configured.
    tracer: Tracer = field(default_factory=lambda: Tracer(TracingConfig(), ROUTER_SERVICE))
    _token_texts: dict[int, str] = field(default_factory=dict)
    _token_bytes: dict[int, bytes] = field(default_factory=dict)
    # Compiles structured-output constraints as the workers will (router/structured.py),
    # on threads of its own (``compile_pool``), so that slow compiles never hold the
    # default pool the prompts are tokenized on.
    grammar_compiler: GrammarCompiler = field(init=False)
    compile_pool: ThreadPoolExecutor = field(init=False)
    # Whether requests may carry a priority: the engines schedule by it (the config check
    # keeps both roles on one policy).
    takes_priority: bool = field(init=False)

    def __post_init__(self) -> None:
        vocab_size = self.model.vocab_size or self.tokenizer.vocab_size
        self.grammar_compiler = GrammarCompiler(self.model.model_dir, vocab_size)
        self.compile_pool = ThreadPoolExecutor(
            max(2, (os.cpu_count() or 2) // 2), thread_name_prefix="grammar-compile"
        )
        policy = self.config.engine_for(Role.DECODE).scheduling_policy
        self.takes_priority = policy is SchedulingPolicy.PRIORITY

    @classmethod
    def build(cls, config: PdserveConfig, auth: InternalAuth = NO_AUTH) -> RouterState:
        """``auth``: the token the router's calls to workers carry."""
        model = model_info(config)
        if model.foreign_pooling is not None:
            logger.warning("%s %s (its sentence-transformers config); embeddings are "
                           "refused (the engine embeds by the last token's hidden state)",
                           model.model_dir, model.foreign_pooling)  # fmt: skip
        index = PrefixIndex()
        lock = threading.Lock()
        events = EventListener(index, lock)
        pool = _Pool(
            create_registry(config),
            events,
            config.router.refresh_interval_s,
            config.router.request_timeout_s,
            config.router.worker_stall_timeout_s,
            # Workers re-register at their next heartbeat: grace for a registry that lost
            # its entries (static lists never do).
            missing_grace_s=config.registry.ttl_s if config.registry.redis_url else 0.0,
            auth=auth,
            block_size=model.block_size,
            model=config.model or "demo",  # what workers register (``worker/runtime.py``)
            connector=config.kv_transfer.connector,
        )
        metrics = RouterMetrics(model.served_name, model.max_model_len)
        metrics.live_plan = LivePlan.from_config(
            config.planner, config.router.min_disagg_tokens, metrics.registry,
            lambda: (len(pool.candidates(Role.PREFILL)), len(pool.candidates(Role.DECODE))),
        )  # fmt: skip
        decode_engine = config.engine_for(Role.DECODE)
        policy = PlacementPolicy(config.router, model.block_size, decode_engine.max_num_seqs,
                                 hybrid=model.hybrid)  # fmt: skip
        dispatcher = Dispatcher(config.router, pool, index, lock, policy, metrics, model.block_size)
        adapters = LoraAdapters(config.lora, pool, model.served_name, pool.registry,
                                config.router.refresh_interval_s)  # fmt: skip
        tokenizer = Tokenizer(model.model_dir)
        return cls(config, model, tokenizer, index, lock, events, pool, metrics, dispatcher,
                   adapters, generation_defaults=GenerationDefaults.read(model.model_dir),
                   harmony_ids=harmony_ids_of(config, model, tokenizer),
                   tool_marker_ids=tool_marker_ids_of(config, tokenizer),
                   image_text=image_text_of(model.vision, tokenizer),
                   scorer=Scorer.build(config.router, tokenizer, model.model_dir),
                   tracer=Tracer(config.tracing, ROUTER_SERVICE,
                                 router_instance(config)))  # fmt: skip

    async def start(self) -> None:
        self.events.start()
        await self.pool.start()
        self.adapters.start()
        if self.metrics.live_plan is not None:
            self.metrics.live_plan.start()
        # llguidance's tokenizer (~1 s for a 128k vocabulary) now, not at the first
        # constrained request; without llguidance, constrained requests say why.
        with contextlib.suppress(StructuredOutputError):
            await asyncio.to_thread(self.grammar_compiler.tokenizer)

    async def stop(self) -> None:
        self.draining = True
        if self.metrics.live_plan is not None:
            await self.metrics.live_plan.stop()
        await self.adapters.stop()
        await self.pool.close()
        self.events.stop()
        self.pool.registry.close()
        self.compile_pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self.tracer.shutdown)  # the last spans, sent

    @property
    def num_running(self) -> int:
        """Sequences in a decode worker's batch (vLLM's meaning). Per decode worker, what
        it last reported in its batch, at most this router's open Generate calls there:
        the router's calls include sequences queued inside the worker, and the worker's
        batch may hold other routers' sequences (so a router whose own sequences all wait
        in its gate or in prefill reports none running)."""
        return min(
            sum(
                min(w.stats.num_running, w.num_running)
                for w in self.pool.workers.values()
                if w.info.role == Role.DECODE
            ),
            self.num_inflight,
        )

    @property
    def num_waiting(self) -> int:
        """Admitted sequences not in a decode batch: before or in prefill, moving their KV,
        or queued on a decode worker."""
        return self.num_inflight - self.num_running

    def token_text(self, token_id: int) -> str:
        """A token's own text (for logprobs); cached, the vocabulary bounds the cache."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.pieces.text(token_id)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (chat logprobs' ``bytes``); cached alike."""
        raw = self._token_bytes.get(token_id)
        if raw is None:
            text = self.token_text(token_id)  # (cached: not decoded again)
            raw = self._token_bytes[token_id] = self.tokenizer.pieces.bytes(token_id, text)
        return raw

    def sampling_params(
        self, body, logprobs: int | None, chat: bool, structured: StructuredOutput | None = None
    ) -> pb.SamplingParams:
        params = sampling_params(body, self.generation_defaults, logprobs, chat)
        for word in bad_words_token_ids(self.tokenizer, body.bad_words or ()):
            params.bad_words_token_ids.add(token_ids=word)
        if structured is not None:
            params.structured_output.CopyFrom(pb.StructuredOutput(**asdict(structured)))
        return params


def harmony_ids_of(
    config: PdserveConfig, model: ModelInfo, tokenizer: Tokenizer
) -> frozenset[int] | None:
    """The Harmony markers' ids for a GPT-OSS checkpoint whose tokenizer has them; None
    for any other. (``model_info`` refused text parsers configured for it.)"""
    if model.model_type != "gpt_oss":
        return None
    ids = marker_ids(tokenizer)
    if ids is None:
        logger.warning(
            "%s is GPT-OSS but its tokenizer lacks the Harmony markers as special tokens: "
            "chat replies are returned as plain text",
            model.model_dir,
        )
        return None
    return ids


# The tool-call parsers whose markers the detokenizer must keep when they are special tokens.
# (Hermes's tags are plain text in Qwen's tokenizers, but some checkpoints make them
# special, and decoding dropped them: the reply's calls came back as bare JSON content.)
_TOOL_MARKERS = {
    ToolCallParser.MISTRAL: MISTRAL_MARKERS,
    ToolCallParser.DEEPSEEK_V3: DEEPSEEK_MARKERS,
    ToolCallParser.KIMI_K2: KIMI_MARKERS,
    ToolCallParser.HERMES: HERMES_MARKERS,
    ToolCallParser.GLM45: HERMES_MARKERS,
    ToolCallParser.MINIMAX_M2: MINIMAX_MARKERS,
}


def tool_marker_ids_of(config: PdserveConfig, tokenizer: Tokenizer) -> frozenset[int]:
    """The ids of the configured tool-call parser's markers that are special tokens."""
    markers = _TOOL_MARKERS.get(config.router.tool_call_parser, ())
    return frozenset(tokenizer.special_token_ids(markers))


def bad_words_token_ids(tokenizer: Tokenizer, words: Iterable[str]) -> list[list[int]]:
    """vLLM's reading of ``bad_words``: each word's tokens as it would start the text, and
    also as it would follow a space where that is other tokens of the same length (so the
    word is banned at the start and in the middle of text alike)."""
    token_ids: list[list[int]] = []
    for word in words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        token_ids.append(alone)
        if len(spaced) == len(alone) and spaced[0] != alone[0]:
            token_ids.append(spaced)
    return token_ids


_FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32


def _first_set(*values):
    return next(v for v in values if v is not None)


def sampling_params(
    body, defaults: GenerationDefaults, logprobs: int | None, chat: bool
) -> pb.SamplingParams:
    """The request's sampling fields; those it leaves unset take the checkpoint's
    defaults, then the API's."""
    params = pb.SamplingParams(
        min_tokens=body.min_tokens,
        temperature=_first_set(body.temperature, defaults.temperature, 1.0),
        # top_p travels as a float32, where one under ~1e-45 is 0, which reads as unset
        # (1.0): the smallest normal float32 keeps it the nucleus of one it asks for.
        top_p=max(_first_set(body.top_p, defaults.top_p, 1.0), _FLOAT32_TINY),
        top_k=_first_set(body.top_k, defaults.top_k, 0),
        min_p=_first_set(body.min_p, defaults.min_p, 0.0),
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=_first_set(body.repetition_penalty, defaults.repetition_penalty, 1.0),
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos,
        logit_bias=body.logit_bias or {},
        allowed_token_ids=body.allowed_token_ids or [],
    )
    limit = body.completion_limit if chat else body.max_tokens
    if limit is not None:
        params.max_tokens = limit
    if body.seed is not None:
        params.seed = body.seed
    if logprobs is not None:
        params.logprobs = logprobs
    return params
