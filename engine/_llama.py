"""A real model inside the engine: a GGUF model run by llama.cpp, whose turns keep their KV.

Long because the backend bridges the engine's async turns to the model's thread and keeps each
conversation's KV across turns and suspensions.

    LlamaBackend.sample(request)
      context      the request's rendered context (the model's own tokens: this model's
                   `TemplateRenderer` is its route's renderer) + the generation prompt
      plan         the KV index (`_kv.py`) picks the sequence and the prefix whose KV is
                   kept: the rollout's own sequence between its turns, the lane's latest
                   response on a WebSocket connection, else the longest cached prefix of
                   this owner's conversations; waits while running turns hold the pool
      run          the model's thread (`_llama_engine.py`) evaluates only the rest, then
                   samples (greedy at temperature 0; a grammar when tools must be called)
      stream       sampled tokens -> text (UTF-8 safe) -> the tool-call convention's parser
                   (`_toolconv.py`) -> text and call events; `Prefilled` reports each
                   evaluation (the `tokens_prefilled` counter)
      end          the sequence, now holding the context and the sampled tokens fed back,
                   is kept by the request's holders (the rollout, the lane) and indexed
                   once they let go

Memory: the model's KV pool (`kv_memory_mb`) is allocated when the model first runs, as
`sequences` of `context_size` tokens each (each sequence its own cells: its numbers never
depend on what the others hold); a token costs `kv_bytes_per_token` (SmolLM2-135M: 23,040
bytes, f16 K and V of 30 layers x 3 KV heads x 64, so a sequence of its 8,192 tokens is 180
MiB and the default 2,048 MB pool holds 11). Kept sequences (suspended rollouts, WebSocket
lanes) stay until every sequence is taken (then the least recently used idle one goes: a
rollout's next turn then evaluates its context again); idle ones nobody keeps are indexed
within `index_mb` (`--kv-cache-mb`).
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import random
from array import array
from collections.abc import AsyncGenerator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import trio
from rollout.protocol import Item, RemoteProtocolError, Tool, ToolChoice

from ._errors import BackendError
from ._interfaces import Holder, Prefilled, SampleEvent, SampleRequest
from ._kv import KVIndex, Slot
from ._llama_engine import EngineReport, Job, LlamaRuntime, RuntimeStats, SamplerSpec

if TYPE_CHECKING:
    from ._llama_vocab import LlamaVocab
    from ._template import TemplateRenderer

__all__ = [
    "DEFAULT_KV_INDEX_MB",
    "DEFAULT_KV_MEMORY_MB",
    "DEFAULT_PREFILL_QUEUE_TOKENS",
    "DEFAULT_SLOTS",
    "LlamaBackend",
    "LlamaConfig",
    "llama_available",
    "model_params",
]

log = logging.getLogger("rollout.engine.llama")

# The KV pool of a model: its sequences (running, kept, indexed), `context_size` tokens each.
# 2 GiB holds 11 sequences of SmolLM2-135M's 8,192 tokens (8 suspended rollouts and 3 running).
DEFAULT_KV_MEMORY_MB = 2048.0
# Of the pool, what idle sequences nobody keeps may hold for later turns (`--kv-cache-mb`).
DEFAULT_KV_INDEX_MB = 256.0
# The most sequences a model's context has (running, kept and indexed together), whatever
# its pool would hold.
DEFAULT_SLOTS = 64
# The most tokens per llama_decode call (every decoding turn's next token, and prompt chunks:
# `_llama_engine.PROMPT_CHUNK`).
DEFAULT_BATCH = 512
# Prompt tokens queued on the model's thread (started, not yet evaluated) past which a new
# turn waits, in arrival order, before its KV is planned: ~40 s of prefill on 2 cores.
DEFAULT_PREFILL_QUEUE_TOKENS = 8192
# The largest `calls=N` model parameter (a forced tool loop's length).
MAX_FORCED_CALLS = 1000


def llama_available() -> str | None:
    """None when llama-cpp-python is importable, else why not (for messages and skips)."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install 'rollout-engine[llama]')"
    return None


@attrs.frozen(kw_only=True)
class LlamaConfig:
    """A GGUF model and how to run it (the models file's `gguf = ...` tables)."""

    path: Path
    threads: int = attrs.field(factory=lambda: max(1, os.cpu_count() or 1))
    context_size: int | None = None  # tokens per sequence; default: the model's own
    kv_memory_mb: float = DEFAULT_KV_MEMORY_MB
    index_mb: float = DEFAULT_KV_INDEX_MB
    slots: int = DEFAULT_SLOTS
    batch: int = DEFAULT_BATCH
    prefill_queue_tokens: int = DEFAULT_PREFILL_QUEUE_TOKENS
    # The chat template, if not the GGUF's own (`tokenizer.chat_template`).
    chat_template: str | None = None


class LlamaBackend:
    """A `Backend` running a GGUF model in this process (see the module docstring). The model
    loads on first use (its renderer's or a turn's); `aclose` stops its thread."""

    def __init__(self, config: LlamaConfig) -> None:
        self.config = config
        self._vocab: LlamaVocab | None = None
        self._model: Any = None  # llama_model_p, loaded once
        self._renderer: TemplateRenderer | None = None
        self._runtime: LlamaRuntime | None = None
        self._start_lock = trio.Lock()
        self.kv: KVIndex | None = None
        self._changed = trio.Event()  # set when a turn ends or a holder lets go
        self._stepped = trio.Event()  # set when the thread reports a step's work
        self._admission = trio.Lock()  # fair: turns are admitted in arrival order
        self.waiting = 0  # turns waiting for the prompt queue or the KV pool
        self.renderer = LazyRenderer(self)

    # --- loading -----------------------------------------------------------------------------

    def model_renderer(self) -> TemplateRenderer:
        """The model's renderer (loads the model's weights, memory-mapped, on first call)."""
        if self._renderer is None:
            from ._llama_vocab import LlamaVocab
            from ._template import TemplateRenderer

            self._model = _load_model(self.config.path)
            self._vocab = LlamaVocab(self._model)
            template = self.config.chat_template or self._vocab.chat_template
            if template is None:
                raise BackendError(f"{self.config.path} has no chat template")
            self._renderer = TemplateRenderer(self._vocab, template)
        return self._renderer

    @property
    def context_limit(self) -> int:
        """Tokens one sequence may hold (the model's context, or `context_size`)."""
        self.model_renderer()
        assert self._vocab is not None
        own = self._vocab.context_length
        return min(own, self.config.context_size) if self.config.context_size else own

    @property
    def kv_bytes_per_token(self) -> int:
        import llama_cpp

        from ._llama_engine import kv_bytes_per_token

        self.model_renderer()
        return kv_bytes_per_token(llama_cpp, self._model)

    @property
    def sequences(self) -> int:
        """Sequences the pool holds: `kv_memory_mb` over one sequence's `context_limit`
        tokens (at least one; at most `slots`)."""
        per_sequence = self.context_limit * self.kv_bytes_per_token
        held = int(self.config.kv_memory_mb * 2**20) // per_sequence
        return max(1, min(self.config.slots, held))

    @property
    def runtime_stats(self) -> RuntimeStats | None:
        """What the model's thread has done (None before the model first runs)."""
        return None if self._runtime is None else self._runtime.stats

    @property
    def kv_cells(self) -> int:
        """Tokens the KV pool holds (every sequence's)."""
        return self.sequences * self.context_limit

    @property
    def context_window(self) -> int:
        """The longest context a request may have: one sequence's."""
        return self.context_limit

    async def start(self) -> LlamaRuntime:
        """Load the model and allocate its KV pool (in a worker thread), once."""
        async with self._start_lock:
            if self._runtime is None:
                self._runtime = await trio.to_thread.run_sync(self._open_runtime)
            return self._runtime

    def _open_runtime(self) -> LlamaRuntime:
        self.model_renderer()
        per_token = self.kv_bytes_per_token
        sequences, capacity = self.sequences, self.context_limit
        openers, blank = self._call_openers()
        runtime = LlamaRuntime(
            self._model,
            cells=sequences * capacity,
            slots=sequences,
            threads=self.config.threads,
            batch=self.config.batch,
            openers=openers,
            blank=blank,
        )
        capacity = min(capacity, runtime.cells_per_sequence)
        self.kv = KVIndex(
            slots=sequences,
            cells=sequences * capacity,
            capacity=capacity,
            index_tokens=int(self.config.index_mb * 2**20) // per_token,
        )
        log.info(
            "model %s loaded: %d sequences of %d tokens (KV %.0f MiB, %d bytes per token)",
            self.config.path.name,
            sequences,
            capacity,
            runtime.cells * per_token / 2**20,
            per_token,
        )
        return runtime

    def _call_openers(self) -> tuple[list[int], frozenset[int]]:
        """The tokens that would start a tool call's envelope in a blank output, and the blank
        tokens (whitespace, or no text): a `no_call` turn's ban (`_toolconv`, "none")."""
        from ._toolconv import opens_call

        vocab = self._vocab
        assert vocab is not None
        openers: list[int] = []
        blank: set[int] = set()
        for token in range(vocab.n_vocab):
            piece = vocab.piece(token, special=False)
            if not piece.strip(b" \t\r\n"):
                blank.add(token)
            elif opens_call(piece):
                openers.append(token)
        return openers, frozenset(blank)

    async def aclose(self) -> None:
        runtime, self._runtime = self._runtime, None
        if runtime is not None:
            await trio.to_thread.run_sync(runtime.close)
        if self._model is not None:
            import llama_cpp

            llama_cpp.llama_model_free(self._model)
            self._model = None

    # --- parameters --------------------------------------------------------------------------

    def check_params(self, params: Mapping[str, str]) -> None:
        """`calls=N` (`smollm2:calls=3`): the model must call a tool while fewer than N calls
        follow the conversation's last user message, then answers in text, whatever the
        request's `tool_choice`: a tool loop of exactly N steps, the same in every mode (the
        count comes from the conversation), for tests and benchmarks."""
        for key, value in params.items():
            if key != "calls":
                raise RemoteProtocolError.invalid(
                    f"Invalid model parameter {key}={value!r}: unknown; known is calls.",
                    code="model_not_found",
                    param="model",
                    status=404,
                )
            if not value.isdigit() or int(value) > MAX_FORCED_CALLS:
                raise RemoteProtocolError.invalid(
                    f"Invalid model parameter calls={value!r}: expected an integer from 0 to "
                    f"{MAX_FORCED_CALLS}.",
                    code="model_not_found",
                    param="model",
                    status=404,
                )

    @staticmethod
    def tool_choice(request: SampleRequest) -> ToolChoice:
        """The request's tool choice, or the one `calls=N` dictates."""
        forced = request.params.get("calls")
        if forced is None or not request.tools:
            return request.tool_choice
        return "required" if request.calls_since_user < int(forced) else "none"

    # --- a turn ------------------------------------------------------------------------------

    async def sample(self, request: SampleRequest) -> AsyncGenerator[SampleEvent, None]:
        from ._chat import ChatToolset
        from ._toolconv import CallParser, grammar_for

        runtime = await self.start()
        renderer = self.model_renderer()
        vocab = self._vocab
        kv = self.kv
        assert vocab is not None and kv is not None
        context = request.context()
        context.extend(renderer.generation_prompt)
        room = self.context_limit - len(context)
        if room <= 0:
            raise BackendError(
                f"The context ({len(context)} tokens with the generation prompt) fills this "
                f"model's context of {self.context_limit} tokens.",
                code="context_length_exceeded",
            )
        budget = min(room, request.max_output_tokens or room)
        choice = self.tool_choice(request)
        toolset = ChatToolset(request.tools, choice) if request.tools else None
        grammar = None
        if toolset is not None or request.text_format is not None:
            grammar = grammar_for(
                toolset or ChatToolset((), "none"),
                choice,
                parallel=request.parallel_tool_calls,
                text_format=request.text_format,
            )
        parser = CallParser(toolset)
        # Tools described, none to be called: the model may not open a call (`_toolconv`).
        no_call = toolset is not None and bool(toolset.tools) and not parser.parses_calls
        holders = tuple(h for h in request.holders if not h.closed)
        self.waiting += 1
        try:
            async with self._admission:
                while runtime.stats.queued_prompt >= self.config.prefill_queue_tokens:
                    await self._stepped.wait()
                plan = None
                while plan is None:
                    try:
                        plan = kv.plan(request.owner, context, holders, reserve=budget)
                    except ValueError as exc:
                        raise BackendError(
                            f"This turn does not fit the model's KV pool: {exc}.",
                            code="context_length_exceeded",
                        ) from None
                    if plan is None:
                        await self._changed.wait()
        finally:
            self.waiting -= 1
        reports: collections.deque[EngineReport] = collections.deque()
        arrived = trio.Event()
        slot, keep = plan.slot, plan.keep

        def on_report(report: EngineReport) -> None:
            reports.append(report)
            arrived.set()
            if report.evaluated or report.end is not None:
                self._stepped.set()
                self._stepped = trio.Event()
            if report.end is not None:
                self._turn_ended(slot, context[:keep], report, holders)

        job = Job(
            seq=slot.seq,
            ops=plan.ops(),
            prompt=context[keep:],
            pos=keep,
            sampler=SamplerSpec(
                temperature=request.temperature,
                top_p=request.top_p,
                seed=request.seed if request.seed is not None else random.getrandbits(32),
                grammar=grammar,
                no_call=no_call,
            ),
            max_tokens=budget,
            report=on_report,
            token=trio.lowlevel.current_trio_token(),
        )
        runtime.submit(job)
        ended: str | None = None
        try:
            decoder = vocab.text_decoder()
            generated: list[int] = []  # the turn's tokens, its end token aside
            text: list[str] = []
            while ended is None:
                await arrived.wait()
                arrived = trio.Event()
                while reports:
                    report = reports.popleft()
                    if report.evaluated:
                        yield Prefilled(report.evaluated)
                    for token in report.sampled:
                        piece = ""
                        if not vocab.is_eog(token):
                            generated.append(token)
                            piece = decoder.feed(token)
                            text.append(piece)
                        for event in parser.feed(piece, 1):
                            yield event
                    if report.end is not None:
                        ended = report.end
                        if report.error is not None:
                            raise BackendError(report.error)
            rest = decoder.flush()
            for event in parser.feed(rest, 0):
                yield event
            if ended == "eog":  # the turn as the model spelled it (before the engine renders it)
                renderer.remember_spelling("".join(text) + rest, generated)
            for event in parser.finish(
                "max_output_tokens" if ended == "length" else "stop",
                input_tokens=request.context_tokens,
                cached_tokens=min(keep, request.context_tokens),
            ):
                yield event
        finally:
            if ended is None:
                runtime.cancel(job)

    def _turn_ended(
        self,
        slot: Slot,
        kept: array[int],
        report: EngineReport,
        holders: Sequence[Holder],
    ) -> None:
        """On the event loop, whoever still listens: record what the sequence now holds and
        who keeps it (or forget it, after an error); wake turns waiting for the pool."""
        kv, runtime = self.kv, self._runtime
        assert kv is not None
        if report.error is not None or report.fed is None:
            kv.drop(slot)
            evicted = [slot.seq]
        else:
            tokens = array("I", kept)
            tokens.extend(report.fed)
            live = [h for h in holders if not h.closed]
            evicted = kv.finish(slot, tokens, live)
            for holder in live:
                holder.keep(self, functools.partial(self._release, holder))
        if runtime is not None:
            runtime.clear(evicted)
        self._changed.set()
        self._changed = trio.Event()

    def _release(self, holder: Holder) -> None:
        kv, runtime = self.kv, self._runtime
        if kv is None or runtime is None:
            return
        runtime.clear(kv.release(holder))
        self._changed.set()
        self._changed = trio.Event()


def model_params() -> Any:
    """llama.cpp's model parameters for a model that runs (not a vocabulary-only load).

    No extra buffer types (weights repacked for AMX and the like): a build for a CPU that
    advertises AMX runs its tile instructions, which fault (SIGSEGV in
    ggml_backend_amx_mul_mat) where the kernel or hypervisor has not enabled the tile state,
    as on the virtual machines this project is tested on; the portable kernels run everywhere.
    """
    import llama_cpp

    params = llama_cpp.llama_model_default_params()
    params.use_extra_bufts = False
    return params


def _load_model(path: Path) -> Any:
    import llama_cpp

    from ._llama_vocab import silence_llama_logs

    silence_llama_logs()
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params())
    if not model:
        raise BackendError(f"llama.cpp could not load the model file {path}")
    return model


class LazyRenderer:
    """The model's `Renderer`, loading the model on first use (a registry names the model
    without loading it: `rollout serve` starts as fast with it as without)."""

    def __init__(self, backend: LlamaBackend) -> None:
        self._backend = backend

    @property
    def template_id(self) -> str:
        return self._backend.model_renderer().template_id

    @property
    def tokenizer(self) -> Any:
        return self._backend.model_renderer().tokenizer

    def render_prefix(self, instructions: str | None, tools: Sequence[Tool]) -> array[int]:
        return self._backend.model_renderer().render_prefix(instructions, tools)

    def render_item(self, item: Item) -> array[int]:
        return self._backend.model_renderer().render_item(item)

    def prefix_text(self, instructions: str | None, tools: Sequence[Tool]) -> str:
        return self._backend.model_renderer().prefix_text(instructions, tools)

    def item_text(self, item: Item) -> str:
        return self._backend.model_renderer().item_text(item)
