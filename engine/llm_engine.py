"""The engine loop: admit requests, schedule a step, run it, report what changed.

    add_request ─► Scheduler.schedule ─► ModelRunner.execute ─► Scheduler.update_from_output
                       (blocks, budget)      (one forward pass)        (tokens, stops, frees)

Single-threaded by contract: a service drives ``step`` from one thread and hands requests
in and results out through queues.
"""

from __future__ import annotations

import logging
import operator
import random
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from common.engine_config import (
    MAX_PRIORITY,
    MAX_SPECULATIVE_TOKENS,
    MIN_PRIORITY,
    EngineConfig,
    SchedulingPolicy,
    SpeculativeMethod,
)
from common.hashing import BlockHash, state_block_hashes, transfer_block_hashes
from common.multimodal import ImageInput
from common.structured_output import STRUCTURED_OUTPUT
from engine.block_pool import BlockPoolObserver
from engine.cpu_tier import CpuTier
from engine.errors import (
    DuplicateRequestError,
    EmptyPromptError,
    InvalidRequestError,
    PromptTooLongError,
    UnknownLoraAdapterError,
)
from engine.grammar import Grammars
from engine.images import (
    PromptImage,
    attention_groups,
    chunk_images,
    decode_pixels,
    prepare_images,
)
from engine.kv_connector import KVPuller
from engine.kv_events import KVEventCollector
from engine.model_runner import ModelRunner, PromptScoring, SequenceChunk
from engine.models.arch import ModelLoadError, read_arch_config
from engine.models.image_processor import ImageError
from engine.models.lora import LoraAdapter
from engine.mrope import MropePositions, mrope_positions
from engine.outputs import CompletionOutput, RequestOutput
from engine.parallel.launch import ShardExtensionSpec
from engine.parallel.shard_client import ShardError
from engine.penalties import TokenCounts
from engine.pooling import PoolingParams
from engine.request import FINISH_REASONS, RemoteKV, Request, RequestStatus
from engine.request_checks import check_pooling, check_remote_kv, check_resume, check_sampling
from engine.resolve import check_hybrid, resolve_device, resolve_dtype, resolve_max_model_len
from engine.sampler import SamplingRow
from engine.sampling_ops import RequestRandom
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)

# A failed pull is logged at most this often (with the count so far): a peer that refuses
# every pull (another KV layout, say) must show in the log, and a dead one must not flood it.
PULL_FAILURE_LOG_S = 10.0


@dataclass(frozen=True, slots=True)
class StepStats:
    num_prompt_tokens: int  # prompt tokens computed (prefill work)
    num_tokens: int  # all tokens computed
    duration_s: float  # the forward pass and sampling


class LLMEngine:
    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        observers: Iterable[BlockPoolObserver] = (),
        kv_puller: KVPuller | None = None,
        recompute_on_pull_failure: bool = True,
        kv_events: KVEventCollector | None = None,
        lora_adapters: Mapping[str, Path] | None = None,
        shard_extension: ShardExtensionSpec | None = None,
    ) -> None:
        """``kv_puller`` pulls prompt KV for requests that come with ``remote_kv`` (decode
        role); when a pull fails the request is prefilled locally, or fails with an error
        if ``recompute_on_pull_failure`` is false. ``lora_adapters``: name -> PEFT adapter
        directory, loaded now; requests choose one by name (``add_request``).
        ``shard_extension``: what a worker runs in each tensor-parallel shard process
        (``ModelRunner``). An engine with tensor parallelism holds processes: ``close``
        it (or they stop when it is garbage collected)."""
        self.config = config or EngineConfig()
        self.kv_puller = kv_puller
        self.recompute_on_pull_failure = recompute_on_pull_failure
        self.model_dir = Path(model_dir)
        self.arch = read_arch_config(model_dir)
        check_hybrid(self.config, self.arch, self.model_dir)
        self.device = resolve_device(self.config)
        self.dtype = resolve_dtype(self.config, self.arch, self.device)
        self.max_model_len = resolve_max_model_len(self.config, self.arch)
        vision = self.arch.vision
        budget = self.config.max_num_batched_tokens
        if vision is not None and vision.bidirectional and budget < vision.tokens_per_image:
            raise ValueError(  # an image is computed in one step
                f"engine.max_num_batched_tokens={budget} is below the "
                f"{vision.tokens_per_image} tokens of one image, which {model_dir} computes "
                "in one step (its image tokens attend to each other)"
            )
        self.runner = ModelRunner(
            model_dir, self.arch, self.config, self.device, self.dtype, self.max_model_len,
            lora_adapters, shard_extension,
        )  # fmt: skip
        try:  # the runner may hold processes (tensor parallelism): stop them if this fails
            self._build(model_dir, observers, kv_events)
        except BaseException:
            self.runner.close()
            raise
        self._rng = random.Random(self.config.seed)
        self._generators: dict[str, RequestRandom] = {}
        # Requests whose images are not decoded yet (pulled prompts: ``engine/images.py``).
        self._undecoded_images: set[str] = set()
        self._bad_handle_logged = False  # (``_pulls_this_prompt``)
        self.num_steps = 0
        # Wall time of the steps that ran a forward pass, whole (scheduling, the pass,
        # outputs): over a window, its growth is how busy the engine was.
        self.busy_s = 0.0
        self.num_pull_failures = 0
        self._pull_failure_logged_at = -PULL_FAILURE_LOG_S
        self.last_step: StepStats | None = None
        self.num_prompt_tokens_computed = 0  # prefill work actually done

    def _build(
        self,
        model_dir: str | Path,
        observers: Iterable[BlockPoolObserver],
        kv_events: KVEventCollector | None,
    ) -> None:
        """The parts around the runner: CPU tier, scheduler, EOS ids, grammars."""
        observers = list(observers)
        if kv_events is not None:
            observers.append(kv_events)
        self.cpu_tier: CpuTier | None = None
        if self.config.cpu_offload_bytes:
            self.cpu_tier = CpuTier(
                self.runner.kv_caches + self.runner.draft_kv_caches,
                self.config.cpu_offload_bytes,
                kv_events.emit if kv_events is not None else None,
                mirror=self.runner.shards,
                num_ranks=self.config.tensor_parallel_size,  # (shards run on this host)
            )
            observers.append(self.cpu_tier)
        vision = self.arch.vision
        # A hybrid model's state slots follow the blocks (``engine/linear_state.py``).
        hybrid = self.arch.linear_attention is not None
        self.scheduler = Scheduler(
            self.config, self.runner.num_blocks, observers, secondary=self.cpu_tier,
            whole_images=vision is not None and vision.bidirectional,
            on_blocks_freed=self.runner.release_state if hybrid else None,
            num_state_blocks=self.runner.shard.blocks_per_slot if hybrid else 0,
            # On decode workers too: the router prefills a chat's next turn where it
            # decoded when only the new turn is uncached there (``router/policy.py``).
            rolling_snapshots=True,
            draft_groups=self.runner.draft_groups,
        )  # fmt: skip
        # An id the model cannot produce can never end a request; left in, banning it
        # before min_tokens would index past the logits.
        self.eos_token_ids = frozenset(i for i in self.arch.eos_token_ids
                                       if 0 <= i < self.arch.vocab_size)  # fmt: skip
        if len(self.eos_token_ids) < len(set(self.arch.eos_token_ids)):
            logger.warning("%s: eos ids %s are outside the vocabulary (%d ids); ignored",
                           model_dir, sorted(set(self.arch.eos_token_ids) - self.eos_token_ids),
                           self.arch.vocab_size)  # fmt: skip
        self.grammars = Grammars(model_dir, self.arch.vocab_size, self.eos_token_ids)

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        *,
        prefill_only: bool = False,
        remote_kv: RemoteKV | None = None,
        output_token_ids: Sequence[int] = (),
        grammar: object | None = None,
        lora_name: str | None = None,
        priority: int = 0,
        pooling: PoolingParams | None = None,
        lora_fingerprint: str | None = None,
        draft_token_ids: Sequence[int] = (),
        images: Sequence[ImageInput | PromptImage] = (),
    ) -> Request:
        """Validate and queue a request. Raises ``InvalidRequestError`` (engine unchanged).

        ``prefill_only``: finish after the first token and hold the prompt's blocks until
        ``release_kv``. ``output_token_ids``: tokens already generated elsewhere (the first
        token, sampled by a prefill worker); ``remote_kv``: where the prompt's KV is.
        ``grammar``: the request's matcher from ``self.grammars.prepare`` (prepared off
        the engine thread); None: prepared here, for a structured request. ``lora_name``:
        one of the engine's LoRA adapters, or None for the base model; ``lora_fingerprint``:
        its files' as the caller expects them (see ``lora_adapter``). ``priority``: lower
        values first, under ``scheduling_policy: priority`` only (elsewhere it must be 0).
        ``pooling``: an embedding request (``engine/pooling.py``): ``params`` must be
        ``EMBEDDING_SAMPLING``, and it finishes with ``RequestOutput.embedding`` once its
        prompt is computed, generating nothing. ``draft_token_ids``: the drafting model's
        drafts after prompt + ``output_token_ids`` (a prefill worker's,
        ``RequestOutput.draft_token_ids``), for the first step to verify; used only with a
        ``speculative_method`` that drafts after each step (mtp, draft_model, eagle3; any
        token ids: a wrong draft is just not kept). ``images``: a vision-language model's,
        one per placeholder run of the prompt, in order (``prepare_images``; ones prepared
        already are taken as they are).
        """
        prompt = self.validate_prompt(prompt_token_ids)
        outputs = self.validate_prompt(output_token_ids, allow_empty=True, param="output_token_ids")
        lora = self.lora_adapter(lora_name, lora_fingerprint)
        if lora is not None and lora.vision_tensors_skipped and images:
            raise InvalidRequestError(
                f"LoRA adapter {lora_name!r} adapts the vision tower too, which this server "
                "does not apply: its outputs for images would not be the adapter's. Send "
                "images without it, or train it on the language model's modules only",
                "images",
            )  # fmt: skip
        prepared = self.prepare_images(prompt, images, decode=remote_kv is None)
        self._check_image_groups(prepared)
        scheduler = self.scheduler
        if request_id in scheduler.requests or request_id in scheduler.held:
            raise DuplicateRequestError(request_id)
        if request_id in scheduler.fetching:  # aborted, but its pull still writes its blocks
            raise DuplicateRequestError(request_id)
        check_sampling(params, self.arch.vocab_size, self.eos_token_ids)
        priority = self.validate_priority(priority)
        computes_here = not (prefill_only or remote_kv is not None or outputs)
        check_pooling(
            pooling,
            params,
            model_name=self.model_dir.name,
            generates=self.runner.model.generates,
            vocab_size=self.arch.vocab_size,
            computes_here=computes_here,
        )
        check_resume(len(prompt), len(outputs), params, self.max_model_len)
        if remote_kv is not None:
            check_remote_kv(
                remote_kv,
                prompt,
                len(outputs),
                params,
                block_size=self.config.block_size,
                can_pull=self.kv_puller is not None,
            )
        if params.structured_output is not None and grammar is None:  # the last check
            grammar = self.grammars.prepare(params.structured_output, outputs)
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            cache_salt=cache_salt,
            lora=lora,
            prefill_only=prefill_only,
            remote_kv=remote_kv,
            output_token_ids=outputs,
            priority=priority,
            pooling=pooling,
            images=prepared,
            mrope=self._mrope(len(prompt), prepared),
        )
        if remote_kv is not None and not self._pulls_this_prompt(request, remote_kv):
            request.remote_kv = None  # computed here (its images decoded here too)
            self.abandon_remote_kv(remote_kv)
        if any(image.pixels is None for image in prepared):
            self._undecoded_images.add(request_id)
        if not params.greedy:
            # Keyed by output position (engine/sampler.py): the tokens generated elsewhere
            # need no skip-ahead, so a resume costs nothing whatever its length.
            seed = params.seed if params.seed is not None else self._rng.randrange(2**63)
            self._generators[request_id] = RequestRandom(
                seed % 2**64, torch.Generator(device=self.device)
            )
        if params.structured_output is not None:
            self.grammars.add(request_id, grammar)
        vocab = self.arch.vocab_size
        drafts = [token for token in draft_token_ids[:MAX_SPECULATIVE_TOKENS] if 0 <= token < vocab]
        if drafts and self.config.speculative_method.drafts_after_step:
            request.set_model_drafts(drafts)
        self.scheduler.add_request(request)
        return request

    def _pulls_this_prompt(self, request: Request, remote: RemoteKV) -> bool:
        """Whether ``remote``'s blocks are ``request``'s prompt's, as far as the handle
        says: its block names are the ones this engine gives the prompt (salt, adapter
        and images included), and no block is listed twice. Pulled blocks are cached
        here under this prompt's names: a handle of another prompt's blocks (a router's
        bug, a script) gave wrong tokens, and every later request sharing the prefix on
        this worker got them too, until the blocks were evicted. If not, the prompt is
        computed here instead (one error logged per engine)."""
        problem = None
        if len(set(remote.block_ids)) != len(remote.block_ids):
            problem = "lists a block twice"
        elif remote.block_hashes:
            names = transfer_block_hashes(
                request.prompt_token_ids[: remote.num_tokens],
                self.config.block_size,
                request.prefix_salt,
                request.image_spans,
            )
            if tuple(remote.block_hashes) != tuple(names):
                problem = "names blocks of another prompt (or salt, adapter, images)"
        if problem is None:
            return True
        if not self._bad_handle_logged:
            self._bad_handle_logged = True
            logger.error("a KV handle for %s %s: its prompt is computed here instead",
                         request.request_id, problem)  # fmt: skip
        return False

    def validate_prompt(
        self, prompt_token_ids: Sequence[int], allow_empty: bool = False, param: str = "prompt"
    ) -> list[int]:
        """The ids as a list, checked: not empty (unless ``allow_empty``), within
        max_model_len, in the vocabulary. ``param``: the field an error names."""
        prompt = list(prompt_token_ids)
        if not prompt and not allow_empty:
            raise EmptyPromptError()
        if len(prompt) > self.max_model_len:
            raise PromptTooLongError(len(prompt), self.max_model_len)
        vocab_size = self.arch.vocab_size
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(
                f"{param} token ids must be integers in [0, {vocab_size}); got {bad[:3]}", param
            )
        return prompt

    def _check_image_groups(self, images: Sequence[PromptImage]) -> None:
        """Where images' tokens attend to each other, each group of them is computed in one
        step: a group larger than the step's budget (adjacent images) is refused, as it
        could never be scheduled."""
        vision = self.arch.vision
        if vision is None or not vision.bidirectional or not images:
            return
        budget = self.config.max_num_batched_tokens
        for start, end in attention_groups([image.span for image in images]):
            if end - start > budget:
                raise InvalidRequestError(
                    f"the images at positions [{start}, {end}) have no token between them: "
                    f"their {end - start} tokens attend to each other and must be computed "
                    f"in one step, past engine.max_num_batched_tokens={budget}",
                    "images",
                )

    def _mrope(
        self, num_prompt_tokens: int, images: Sequence[PromptImage]
    ) -> MropePositions | None:
        """A prompt's 3-D rotary positions, for a model with M-RoPE and a prompt with
        images (``engine/mrope.py``); None where they are the sequence's."""
        vision = self.arch.vision
        if vision is None or not vision.mrope or not images:
            return None
        assert vision.grid is not None
        grids = [(image.span.offset, *vision.grid.token_grid(*image.size)) for image in images]
        return mrope_positions(num_prompt_tokens, grids)

    def prepare_images(
        self,
        prompt: Sequence[int],
        images: Sequence[ImageInput | PromptImage],
        decode: bool = True,
    ) -> tuple[PromptImage, ...]:
        """``images`` of a request with ``prompt``, checked and decoded (without
        ``decode``: their headers checked; ``engine.images.prepare_images``). Reads nothing
        that changes: services call it off the engine thread, since decoding a large image
        takes milliseconds."""
        processing = self.runner.image_processing
        return prepare_images(prompt, images, self.arch.vision, processing, decode)

    def validate_priority(self, priority: int) -> int:
        """``priority`` as an int (numpy integers too; not a bool), if this engine takes it."""
        try:
            value = operator.index(priority)
        except TypeError:
            value = None
        if value is None or isinstance(priority, bool) or not MIN_PRIORITY <= value <= MAX_PRIORITY:
            raise InvalidRequestError(
                f"priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}]", "priority"
            )
        priority = value
        if priority and self.config.scheduling_policy is not SchedulingPolicy.PRIORITY:
            raise InvalidRequestError(
                f"priority {priority} needs engine.scheduling_policy: priority (this engine "
                f"serves {self.config.scheduling_policy.value})",
                "priority",
            )
        return priority

    def lora_adapter(
        self, lora_name: str | None, fingerprint: str | None = None
    ) -> LoraAdapter | None:
        """The loaded adapter ``lora_name`` names (None: the base model). Raises
        ``InvalidRequestError`` for a name not loaded, and for one whose files are not
        ``fingerprint``'s (given): the adapter was reloaded under its name after the
        router placed the request, and a prompt's KV pulled from a worker that computed
        it with the old files would be decoded with the new ones and cached under their
        key, serving every later request of the new files from it."""
        if lora_name is None:
            return None
        adapter = self.runner.lora_adapters.get(lora_name)
        if adapter is None:
            raise UnknownLoraAdapterError(lora_name, list(self.runner.lora_adapters))
        if fingerprint is not None and adapter.fingerprint != fingerprint:
            raise InvalidRequestError(
                f"LoRA adapter {lora_name!r} was loaded again with other files while the "
                "request was placed; retry it", "lora_name",
            )  # fmt: skip
        return adapter

    def read_lora_adapter(self, name: str, path: str | Path) -> LoraAdapter:
        """Read an adapter's files for this model (any thread: slow, and it touches no
        engine state); ``add_lora_adapter`` then makes it servable. Whatever fails here
        is the files' fault (missing, unreadable, corrupt, for another model), raised as
        ``InvalidRequestError`` naming what is wrong."""
        try:
            return self.runner.read_lora_adapter(name, path)
        except Exception as exc:  # a corrupt file raises safetensors' own error
            message = str(exc) if isinstance(exc, ModelLoadError) else f"{path}: {exc}"
            raise InvalidRequestError(message, "lora_path") from None

    def add_lora_adapter(self, adapter: LoraAdapter, max_adapters: int | None = None) -> bool:
        """Serve ``adapter`` under its name from the next request on (engine thread).
        False if that very adapter (same name and weights) is loaded already. Raises
        ``InvalidRequestError`` if the name is taken by other weights (unload it first:
        the old weights' requests and cached KV keep their own key, so nothing mixes),
        ``max_adapters`` are loaded, or (tensor parallelism) another rank cannot read
        the adapter's files or reads other files than rank 0 did."""
        adapters = self.runner.lora_adapters
        loaded = adapters.get(adapter.name)
        if loaded is not None:
            if loaded.key == adapter.key:
                return False
            raise InvalidRequestError(
                f"LoRA adapter {adapter.name!r} is loaded with other weights "
                f"({loaded.fingerprint}, these are {adapter.fingerprint}): unload it first",
                "lora_name",
            )
        if max_adapters is not None and len(adapters) >= max_adapters:
            raise InvalidRequestError(
                f"{len(adapters)} LoRA adapters are loaded, the most allowed "
                f"(lora.max_adapters={max_adapters}): unload one first",
                "lora_name",
            )
        try:
            self.runner.share_lora_adapter(adapter)
        except ShardError as exc:
            raise InvalidRequestError(str(exc), "lora_path") from None
        adapters[adapter.name] = adapter
        return True

    def unload_lora_adapter(self, name: str) -> bool:
        """Stop serving adapter ``name`` to new requests (engine thread); False if it was
        not loaded. Requests already admitted with it finish with it: they hold the
        adapter, and its memory goes when the last of them does. Its cached KV stays
        until evicted, keyed by its weights: loading the same files again finds it."""
        return self.runner.lora_adapters.pop(name, None) is not None

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort_request(request_id)
        if request is None:
            return None
        if request_id in self.scheduler.fetching:  # its blocks stay until the pull ends
            assert self.kv_puller is not None
            self.kv_puller.abort_fetch(request_id)
        elif request.remote_kv is not None:
            self.abandon_remote_kv(request.remote_kv)  # never pulled: the peer may free it
        self._forget(request_id)
        return self._output(request, [])

    def abandon_remote_kv(self, remote: RemoteKV) -> None:
        """Nothing here will read ``remote``'s blocks: the peer may free them now rather
        than when its lease expires (``KVPuller.abandon``)."""
        if self.kv_puller is not None:
            self.kv_puller.abandon(remote)

    def _forget(self, request_id: str) -> None:
        """Drop a finished request's sampling state and its block-table row."""
        self._generators.pop(request_id, None)
        self._undecoded_images.discard(request_id)
        self.runner.release_request(request_id)
        self.grammars.discard(request_id)

    def holds_kv(self, request_id: str) -> bool:
        """Whether a finished prefill-only request still holds its blocks."""
        return request_id in self.scheduler.held

    def held_block_names(self, request_id: str) -> list[BlockHash]:
        """The transfer names of a held request's prompt blocks
        (``common.hashing.transfer_block_hashes``, salted as its prefix cache is: by
        tenant and adapter weights). KeyError if it holds none."""
        request = self.scheduler.held[request_id]
        return transfer_block_hashes(
            request.prompt_token_ids,
            self.config.block_size,
            request.prefix_salt,
            request.image_spans,
        )

    def held_state_block_ids(self, request_id: str) -> list[int]:
        """The blocks holding a held request's linear-attention states (a hybrid model's),
        exported with its prompt's blocks and named after them
        (``common.hashing.state_block_hashes``); empty for other models. KeyError if it
        holds none."""
        self.scheduler.held[request_id]  # KeyError if it holds none
        return self.runner.state_block_ids(request_id)

    def release_kv(self, request_id: str) -> bool:
        """Free the blocks a finished prefill-only request held. False if none were held."""
        return self.scheduler.release_held(request_id)

    def close(self) -> None:
        """Stop the tensor-parallel ranks' processes (a no-op without); idempotent. The
        engine cannot step afterwards."""
        self.runner.close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def has_work(self) -> bool:
        """Unfinished requests, KV pulls in flight, or blocks quarantined for late pulls
        (a step polls for their release): keep calling ``step``."""
        return self.scheduler.has_work

    def has_pulls_or_requests(self) -> bool:
        """``has_work`` less quarantined blocks: what a caller should step for promptly."""
        return self.scheduler.has_requests_or_pulls

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[RequestOutput]:
        """One engine step. Returns an output for every request that produced a token or
        finished. Returns at once, with no forward pass, when only pulls are in flight."""
        step_start = time.perf_counter()
        outputs = self._poll_fetches()
        outputs += self._decode_images()
        scheduler_output = self.scheduler.schedule()
        if self.cpu_tier is not None:
            # Save the blocks this schedule evicted before anything may overwrite them
            # (pulls below, the forward pass), then load this step's CPU hits into theirs.
            self.cpu_tier.flush()
            for load in scheduler_output.loads:
                self.cpu_tier.load(load.block_hashes, load.block_ids)
        outputs += self._start_fetches(scheduler_output)
        if not scheduler_output.scheduled:
            return outputs
        chunks = self._chunks(scheduler_output)
        start = time.perf_counter()
        result = self.runner.execute(chunks)
        self.last_step = StepStats(
            num_prompt_tokens=sum(
                max(min(len(c.token_ids), prompt_len - c.start_pos), 0)
                for c, prompt_len in zip(
                    chunks,
                    (s.request.num_prompt_tokens for s in scheduler_output.scheduled),
                    strict=True,
                )
            ),
            num_tokens=scheduler_output.num_scheduled_tokens,
            duration_s=time.perf_counter() - start,
        )
        self.num_prompt_tokens_computed += self.last_step.num_prompt_tokens
        for item in scheduler_output.scheduled:
            scored = result.prompt_logprobs.get(item.request.request_id)
            if scored:
                item.request.prompt_logprobs.extend(scored)
        for request_id, embedding in result.embeddings.items():
            self.scheduler.requests[request_id].embedding = embedding
        progressed = self.scheduler.update_from_output(scheduler_output, result.sampled)
        # The drafting model's drafts, set on the scheduled requests themselves: a prefill-only
        # one has finished by now, and its drafts go out with its output.
        draft_model = self.config.speculative_method is SpeculativeMethod.DRAFT_MODEL
        for item in scheduler_output.scheduled:
            request = item.request
            drafts = result.drafts.get(request.request_id)
            if drafts is not None:
                request.set_model_drafts(drafts)
            if draft_model:  # it read the tokens the step made known, up to its slots' end
                end = result.draft_kv_end.get(request.request_id)
                request.draft_kv_end = request.num_computed_tokens + 1 if end is None else end
        self.num_steps += 1
        for request, num_new in progressed:
            if request.request_id in self.grammars:
                self._advance_grammar(request)
            if request.status.finished:
                self._forget(request.request_id)
            outputs.append(self._output(request, request.output_token_ids[-num_new:]))
        self.busy_s += time.perf_counter() - step_start
        return outputs

    def _advance_grammar(self, request: Request) -> None:
        """Feed the token just sampled to the request's grammar. A complete grammar ends
        the request as stopped at once (only EOS could follow: no step is spent on it,
        and neither ``min_tokens`` nor ``ignore_eos`` can add off-grammar tokens; one
        complete at ``max_tokens`` is ``stop`` too). A token the matcher refuses (with
        the masks, llguidance giving up on the grammar) ends it with an error that is
        the request's own fault (``error_param``). Structured requests never verify
        drafts, so a step appends one token to them."""
        request_id = request.request_id
        problem = self.grammars.accept(request_id, request.output_token_ids[-1])
        if problem is not None:  # whatever else ended it, that token must not go out
            if request.status is RequestStatus.FINISHED_PREFILLED:
                self.scheduler.release_held(request_id)
            elif not request.status.finished:
                self.scheduler.abort_request(request_id)
            request.status = RequestStatus.FINISHED_ABORTED
            request.error, request.error_param = problem, STRUCTURED_OUTPUT
            return
        if not self.grammars.complete(request_id):
            return
        if request.status in (RequestStatus.RUNNING, RequestStatus.FINISHED_PREFILLED):
            self.scheduler.stop_early(request)
        elif request.status is RequestStatus.FINISHED_LENGTH:
            request.status = RequestStatus.FINISHED_STOPPED  # complete, not cut short

    def _start_fetches(self, scheduler_output: SchedulerOutput) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for order in scheduler_output.fetches:
            request = order.request
            # Everything was in the local prefix cache (a hybrid model's states are not:
            # they are pulled whatever the KV hits).
            if not order.local_block_ids and self.runner.state_slots is None:
                remote = request.remote_kv
                self.scheduler.finish_fetch(request.request_id, ok=True)
                if remote is not None:  # nothing pulled: no transfer tells the peer
                    self.abandon_remote_kv(remote)
                continue
            assert self.kv_puller is not None and request.remote_kv is not None
            remote = request.remote_kv
            if remote.start_by is not None and now > remote.start_by:  # see RemoteKV
                reason = "its lease ran out while it waited to be scheduled"
                output = self._end_fetch(request, False, reason)
                if output is not None:
                    outputs.append(output)
                continue
            names = transfer_block_hashes(
                request.prompt_token_ids[: remote.num_tokens],
                self.config.block_size,
                request.prefix_salt,
                request.image_spans,
            )
            remote_ids, local_ids = order.remote_block_ids, order.local_block_ids
            pulled_names = [names[i] for i in order.block_indices]
            if self.runner.state_slots is not None:  # a hybrid model's states, beside
                local_states = self.runner.reserve_state(request.request_id)
                if len(remote.state_block_ids) != len(local_states):
                    reason = (f"the prefill worker sent {len(remote.state_block_ids)} state "
                              f"blocks; this model's states take {len(local_states)}")  # fmt: skip
                    output = self._end_fetch(request, False, reason)
                    if output is not None:
                        outputs.append(output)
                    continue
                remote_ids = [*remote_ids, *remote.state_block_ids]
                local_ids = [*local_ids, *local_states]
                pulled_names += state_block_hashes(names[-1], len(local_states))
            self.kv_puller.start_fetch(
                request.request_id, remote, remote_ids, local_ids, pulled_names
            )
        return outputs

    def _poll_fetches(self) -> list[RequestOutput]:
        if self.kv_puller is None or not (self.scheduler.fetching or self.scheduler.kv.quarantined):
            return []
        pulls = self.kv_puller.poll_fetches()
        outputs = []
        for request_id, ok in [(r, True) for r in pulls.done] + [(r, False) for r in pulls.failed]:
            request = self.scheduler.fetching.get(request_id)
            if request is None:
                continue
            reason = "" if ok else pulls.failed[request_id]
            output = self._end_fetch(request, ok, reason, request_id in pulls.late)
            if output is not None:
                outputs.append(output)
        for transfer_id in pulls.released:  # (after the failures: the same poll may say both)
            self.scheduler.release_quarantine(transfer_id)
            self.runner.release_state(_quarantine_holder(transfer_id))
        return outputs

    def _end_fetch(
        self, request: Request, ok: bool, reason: str, late: bool = False
    ) -> RequestOutput | None:
        """A pull ended (or will never start): the request continues, recomputes its
        prompt, or finishes with an error; that last one's output is returned. A ``late``
        failure's blocks (a hybrid model's state slot too) stay quarantined until the
        puller reports its transfer released."""
        given_up = request.status is RequestStatus.FINISHED_ABORTED  # aborted meanwhile
        remote = request.remote_kv
        if late:
            assert remote is not None
            self.runner.park_state(request.request_id, _quarantine_holder(remote.transfer_id))
        self.scheduler.finish_fetch(request.request_id, ok, self.recompute_on_pull_failure, late)
        if not ok and not given_up:  # an abort's pull fails by design
            # Nothing here will read the peer's blocks now: it may free them at once. Left
            # to its lease, a pair that never pulls (a layout or dtype refused at the
            # handshake) held every prompt's blocks there for ``lease_s`` (30 s).
            assert self.kv_puller is not None and remote is not None
            self.kv_puller.abandon(remote)
            self.num_pull_failures += 1
            if request.error is not None:
                request.error += f": {reason}"
            now = time.monotonic()
            if now - self._pull_failure_logged_at >= PULL_FAILURE_LOG_S:
                self._pull_failure_logged_at = now
                logger.warning(
                    "pulling the KV of %s failed (%s); %s (%d failed pulls so far)",
                    request.request_id, reason,
                    "it fails" if request.error is not None else "its prompt is recomputed",
                    self.num_pull_failures,
                )  # fmt: skip
        if request.status is RequestStatus.FINISHED_ABORTED and request.error is not None:
            self._forget(request.request_id)
            return self._output(request, [])
        return None

    def _decode_images(self) -> list[RequestOutput]:
        """Decode the images of requests that left them undecoded (their prompt KV was to
        be pulled) and now wait to compute their prompt here (the pull failed, or they were
        preempted). One whose image cannot be decoded fails as invalid input (the prefill
        worker read the same bytes, so only differing image libraries get here); its
        output is returned."""
        outputs = []
        for request_id in list(self._undecoded_images):
            request = self.scheduler.requests.get(request_id)
            if request is None:  # finished (its KV pulled) or aborted: never decoded
                self._undecoded_images.discard(request_id)
                continue
            waiting = request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            if not waiting or request.remote_kv is not None:
                continue
            try:
                self._decode_pixels(request)
            except Exception as exc:  # one request's images: never the whole step's fault
                if not isinstance(exc, ImageError):
                    logger.exception("decoding the images of %s failed", request_id)
                request.error, request.error_param = f"images: {exc}", "images"
                output = self.abort_request(request_id)
                if output is not None:
                    outputs.append(output)
        return outputs

    def _decode_pixels(self, request: Request) -> None:
        """Every undecoded image of ``request`` (on the engine thread: a rare path)."""
        processing = self.runner.image_processing
        assert processing is not None
        for image in request.images:
            decode_pixels(image, processing)
        self._undecoded_images.discard(request.request_id)

    def _chunks(self, scheduler_output: SchedulerOutput) -> list[SequenceChunk]:
        kv = self.scheduler.kv
        chunks = []
        # A draft model's catch-up tokens this step (``_draft_inputs``).
        lead_budget = self.config.max_num_batched_tokens
        for item in scheduler_output.scheduled:
            request = item.request
            drafts = item.draft_token_ids
            start = request.num_computed_tokens
            end = start + item.num_scheduled_tokens - len(drafts)  # the request's own tokens
            if request.request_id in self._undecoded_images and start < request.images[-1].span.end:
                # Preempted and admitted again within one schedule (``_decode_images`` saw
                # it running). An error here fails the step: see ``_decode_images``.
                self._decode_pixels(request)
            sampling = None
            if item.samples and request.pooling is None:
                if request.sampling_params.has_penalties and request.token_counts is None:
                    request.token_counts = TokenCounts()
                sampling = SamplingRow(
                    request.sampling_params,
                    self._generators.get(request.request_id),
                    request.token_ids_banned_now(),
                    request.prompt_token_ids,
                    request.output_token_ids,
                    request.token_counts,
                    self.grammars.allowed(request.request_id)
                    if request.request_id in self.grammars
                    else None,
                    drafts,
                )
            chunks.append(
                SequenceChunk(
                    request_id=request.request_id,
                    token_ids=request.token_ids_between(start, end) + drafts,
                    start_pos=start,
                    block_ids=kv.block_ids_view(request.request_id),
                    sampling=sampling,
                    scoring=_prompt_scoring(request, start, end),
                    lora=request.lora,
                    pooling=request.pooling if item.samples else None,
                    images=chunk_images(
                        request.images, request.image_features, start, end, request.cache_salt
                    )
                    if request.images
                    else None,
                    rope_positions=None
                    if request.mrope is None
                    else request.mrope.rows(start, end + len(drafts)),
                    restore_block_ids=item.restore_block_ids,
                    snapshot_block_ids=item.snapshot_block_ids,
                )
            )
            if self.config.speculative_method.drafts_after_step:
                lead_budget -= self._draft_inputs(chunks[-1], item, end, lead_budget)
        return chunks

    def _draft_inputs(
        self, chunk: SequenceChunk, item: ScheduledRequest, end: int, lead_budget: int
    ) -> int:
        """What the drafting model's passes after this step need of ``chunk``
        (``engine/mtp_drafts.py``; a draft model's lead, ``engine/draft_model.py``): the
        prompt token after a chunk that is not the last, and how many drafts to
        propose after a sampling one: as many as the next step could verify, by the draft
        budget's rule (``draft_budget.py``: at most twice the drafts this step verifies,
        if it keeps them all; none while paused, or for requests that cannot speculate).
        Returns the lead tokens it gave a draft model beyond one: at most ``lead_budget``."""
        request = item.request
        used = 0
        if self.config.speculative_method is SpeculativeMethod.DRAFT_MODEL:
            used = _draft_lead(request, chunk, lead_budget)
        if not item.samples:
            chunk.next_token_id = request.token_ids_between(end, end + 1)[0]
            return used
        budget = request.draft_budget
        if (  # (a prefill-only request drafts for its decode worker's first step)
            request.pooling is not None
            or request.sampling_params.structured_output is not None
            or (budget is not None and budget.paused_steps > 0)
        ):
            return used
        most = self.config.num_speculative_tokens
        if item.draft_token_ids:  # the budget's next allowance, if every draft is kept
            most = min(most, 2 * len(item.draft_token_ids))
        elif budget is not None:  # no drafts to verify: the allowance stays
            most = min(most, budget.allowed)
        left = request.max_tokens - request.num_output_tokens - 2  # after this step's token
        chunk.num_drafts = max(0, min(most, left))
        return used

    def _output(self, request: Request, new_token_ids: list[int]) -> RequestOutput:
        finish_reason = FINISH_REASONS.get(request.status)
        wants_logprobs = request.sampling_params.logprobs is not None
        completion = CompletionOutput(
            index=0,
            token_source=request.output_token_ids,
            num_tokens=request.num_output_tokens,
            finish_reason=finish_reason.value if finish_reason else None,
            stop_reason=request.stop_reason,
            logprob_source=request.output_logprobs if wants_logprobs else None,
            num_logprobs=len(request.output_logprobs),
        )
        held = request.status is RequestStatus.FINISHED_PREFILLED
        prompt_logprobs = None
        if request.sampling_params.prompt_logprobs is not None and not request.scores_prompt:
            if request.prompt_logprobs_output is None:  # scored for good (none is redone)
                request.prompt_logprobs_output = [None, *request.prompt_logprobs]
            prompt_logprobs = request.prompt_logprobs_output
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=request.status.finished,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            new_token_ids=list(new_token_ids),
            error=request.error,
            error_param=request.error_param,
            kv_block_ids=self.scheduler.kv.get_block_ids(request.request_id) if held else None,
            num_remote_blocks_pulled=request.num_remote_blocks_pulled,
            times=request.times,
            prompt_logprobs=prompt_logprobs,
            embedding=request.embedding,
            draft_token_ids=list(request.current_model_drafts) if held else [],
        )

    # ------------------------------------------------------------------ checks

    def leak_report(self) -> list[str]:
        """Everything still held: empty when the engine is idle and clean."""
        problems = self.scheduler.leak_report() + self.runner.leak_report()
        if self.cpu_tier is not None:
            problems += self.cpu_tier.leak_report()
        if self._generators:
            problems.append(f"{len(self._generators)} sampling generators still held")
        if self.grammars:
            problems.append(f"{len(self.grammars)} grammar matchers still held")
        if self._undecoded_images:
            problems.append(f"{len(self._undecoded_images)} requests' undecoded images held")
        return problems


def _quarantine_holder(transfer_id: str) -> str:
    """The name a late pull's state slot is kept under: no request id looks like it."""
    return f"quarantine:{transfer_id}"


def _prompt_scoring(request: Request, start: int, end: int) -> PromptScoring | None:
    """The prompt tokens a chunk of positions ``start .. end`` scores: those after the
    positions it computes, less what an earlier pass (before a preemption) scored."""
    if not request.scores_prompt:
        return None
    first = max(start, len(request.prompt_logprobs))
    last = min(end, request.num_prompt_tokens - 1)
    if first >= last:
        return None
    targets = request.prompt_token_ids[first + 1 : last + 1]
    return PromptScoring(first - start, targets, request.sampling_params.prompt_logprobs)


def _draft_lead(request: Request, chunk: SequenceChunk, budget: int) -> int:
    """Give ``chunk`` the tokens up to its first that the draft model has not read
    (``engine/draft_model.py``); returns how many beyond one, at most ``budget`` (the
    rest wait for later steps). None are missing when the request's last step left the
    draft at the chunk. A first chunk misses its own first token only: a prefix-cache
    hit's blocks hold the draft's KV of the request that computed them. A request whose
    prompt KV came from a prefill worker misses all of it (pulled blocks hold no draft
    KV), and one catching up misses what it has not read yet."""
    start, end = chunk.start_pos, request.draft_kv_end
    if end == start + 1:
        return 0
    if 0 < end < start + 1:  # catching up
        first = end
    elif end == 0 and request.num_remote_blocks_pulled > 0:
        first = 0
    else:  # a first chunk, or after a preemption: the cached blocks hold its KV
        first = start
    count = start + 1 - first
    if count > 1 + budget:
        count = max(1, budget)
        chunk.draft_catching_up = True
    chunk.draft_lead = request.token_ids_between(first, first + count)
    chunk.draft_lead_pos = first
    return count - 1
