"""The model's thread: one llama.cpp context, stepped in batches across every running turn.

Long because one thread steps every running turn in shared batches: admission, KV reuse and
eviction, sampling, and the statistics that `/metrics` reports.

llama.cpp's calls block (a 512-token prefill takes seconds on a small CPU), so they never run
on the event loop. One thread per model owns the model, its context (`slots` sequences, each
with KV cells of its own) and one batch, and loops:

    take commands     start a job (its sequence operations first: evictions, a truncated or
                      copied prefix, `_kv.Plan.ops`), cancel one, clear sequences, stop
    build a batch     every decoding job's last sampled token (one each), then prompt
                      tokens of jobs still reading their prompt (the scheduling policy below)
    decode            one `llama_decode` for the batch
    sample            each job whose logits came out samples a token with its own sampler
                      chain (grammar, then greedy or top-p/temperature; a `no_call` job's
                      banned openers masked while its output is blank); an end-of-generation
                      token ends the job (not fed back), any other is fed at the next step
    report            each job's news goes to its trio task (`trio.lowlevel.TrioToken`):
                      tokens evaluated, tokens sampled, and at the end what its sequence holds

Scheduling policy (one step = one `llama_decode`):

    a decode step     every decoding job's next token, one each, in one batch: decoding
                      jobs never wait for one another (the batch grows with them)
    a read step       one prompt chunk (`PROMPT_CHUNK` tokens, fewer at a prompt's end) of the
                      oldest job still reading its prompt, alone
    alternation       while some decode and a prompt waits, the steps alternate: a long
                      prompt delays the others' next token by one chunk (~0.5 s on 2 cores),
                      never by its whole length, and is read at half the steps; the oldest
                      prompt finishes first (it starts decoding soonest). On a CPU a step's
                      cost is its tokens' (128-token chunks read as fast as 512-token ones),
                      so keeping chunks apart from decoding costs no throughput
    suspended         a rollout at a tool call has no job: its sequence keeps its KV and costs
                      no compute (`_kv.py` decides what stays)

Queued prompt tokens (of jobs started, not yet evaluated) are bounded by the caller
(`LlamaBackend`, `prefill_queue_tokens`): a turn past the bound waits on the event loop before
its KV is planned. `stats` counts what the thread did (steps, tokens by kind, its busy time
by kind of step, sequences per step): the `rollout_model_*` metrics.

A job is cancelled between steps (its prompt or output may stop mid-way; what its sequence
holds is reported either way). The thread never touches the KV index: the event loop decides
which sequence a job runs on and what it keeps (`_kv.py`), the thread only applies it.

Evaluation boundaries: llama.cpp's numbers for a sequence depend on how its own tokens are
grouped into evaluations (a prompt read in 64-token chunks gives logits up to ~0.8 away from
128-token ones), and on company that reads a prompt: a chunk evaluated beside other sequences'
tokens (two equal chunks, or a chunk beside decoding tokens) can come out ~0.5 away, and
flash attention's kernel moves with the longest sequence in the batch. What does not move:
one token per sequence beside other sequences' single tokens (each sequence has its own KV
cells, `kv_unified = False`; measured bit for bit here over hundreds of steps). So flash
attention is off, a prompt is always cut at the same places (`PROMPT_CHUNK` tokens from its
first position) and each chunk is evaluated alone, and a decode step holds one token per
sequence: a turn computes the same logits bit for bit whether it runs alone or batched with
any others (tests/test_llama_batching.py), and two turns that keep the same prefix and
evaluate the same tokens compute the same.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import queue
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import trio

from ._toolconv import Grammar, GrammarError

__all__ = [
    "PROMPT_CHUNK",
    "EngineReport",
    "Job",
    "LlamaRuntime",
    "RuntimeStats",
    "SamplerSpec",
    "kv_bytes_per_token",
]

log = logging.getLogger("rollout.engine.llama")

# A prompt is evaluated in chunks of this many tokens from its first position, whatever else
# runs: its numbers then never depend on the other jobs (see "Evaluation boundaries"). While
# other jobs decode, a step carries one chunk: their next token waits ~0.5 s on 2 cores, not a
# whole batch. (Measured here, SmolLM2-135M on 2 cores: 128-token chunks prefill as fast as
# 512-token ones, ~250 tokens/s.)
PROMPT_CHUNK = 128


# Buckets of the sequences-per-step histogram (`rollout_model_step_sequences`).
STEP_SEQUENCE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@attrs.define
class RuntimeStats:
    """What the model's thread has done. Each field has one writer: `submitted_prompt` the
    event loop (`submit`), the rest the thread; readers (/metrics) see each field whole."""

    steps: int = 0  # llama_decode calls
    prompt_tokens: int = 0  # prompt tokens evaluated
    decode_tokens: int = 0  # sampled tokens fed back (one per decoding job per step)
    # The thread's busy time (decode and sampling), by kind of step: "prefill" when the step
    # evaluated prompt tokens (with or without decoding jobs beside them), else "decode".
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    sequences: int = 0  # the sum over steps of the sequences each step served
    step_sequences: list[int] = attrs.field(factory=lambda: [0] * len(STEP_SEQUENCE_BUCKETS))
    submitted_prompt: int = 0  # prompt tokens of the jobs submitted
    retired_prompt: int = 0  # prompt tokens evaluated, or dropped with their job
    decoding: int = 0  # jobs decoding after the last step
    prefilling: int = 0  # jobs (started) still reading their prompt

    @property
    def queued_prompt(self) -> int:
        """Prompt tokens submitted and not yet evaluated (nor dropped)."""
        return max(0, self.submitted_prompt - self.retired_prompt)


@attrs.frozen
class SamplerSpec:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    grammar: Grammar | None = None
    # While the output is blank, the runtime's `openers` (the tokens that would start a tool
    # call's envelope) are banned: tool_choice "none" with tools described (`_toolconv`).
    no_call: bool = False


@attrs.frozen
class EngineReport:
    """A job's news from one step (delivered on the event loop, in order)."""

    evaluated: int = 0  # tokens the model evaluated for it in this step
    sampled: tuple[int, ...] = ()  # tokens sampled (at most one per step)
    # At the end: why ("eog", "length", "cancelled", "error"), and how many tokens its
    # sequence now holds from its first prompt position (prompt evaluated + tokens fed back).
    end: str | None = None
    fed: array[int] | None = None
    error: str | None = None


@attrs.define(eq=False)
class Job:
    """One turn on one sequence. The thread owns the fields below `cancelled`."""

    seq: int
    ops: list[tuple[str, int, int, int]]
    prompt: array[int]  # tokens to evaluate, from position `pos`
    pos: int
    sampler: SamplerSpec
    max_tokens: int  # tokens it may sample (the end-of-generation token included)
    report: Callable[[EngineReport], None]  # runs on the event loop
    token: trio.lowlevel.TrioToken
    cancelled: bool = False  # set from the event loop; read by the thread between steps
    # --- the thread's ---
    read: int = 0  # prompt tokens evaluated
    fed: array[int] = attrs.field(factory=lambda: array("I"))
    next_token: int | None = None  # sampled, to be fed at the next step
    sampled: int = 0
    chain: Any = None  # llama_sampler_p
    grammar: Any = None  # llama_sampler_p: a greedy job's grammar, applied apart (`_sample`)
    blank: bool = True  # every token sampled so far is whitespace (or has no text)

    def deliver(self, report: EngineReport) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            self.token.run_sync_soon(self.report, report)


def kv_bytes_per_token(llama: Any, model: Any) -> int:
    """KV cache bytes per token of a model (f16 K and V): 2 * layers * kv_heads * head_dim * 2."""
    layers = llama.llama_model_n_layer(model)
    heads = llama.llama_model_n_head(model)
    kv_heads = llama.llama_model_n_head_kv(model)
    head_dim = llama.llama_model_n_embd(model) // max(1, heads)
    return int(2 * layers * kv_heads * head_dim * 2)


class LlamaRuntime:
    """A loaded model, its context and its thread (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        *,
        cells: int,
        slots: int,
        threads: int,
        batch: int,
        openers: Sequence[int] = (),
        blank: frozenset[int] = frozenset(),
    ) -> None:
        """`model`: a loaded `llama_model_p` (the caller frees it, after `close`). `openers`:
        the tokens a `no_call` job may not sample while its output is blank, that is while it
        has sampled only `blank` tokens."""
        import llama_cpp as llama

        self._llama = llama
        self.model = model
        self.vocab = llama.llama_model_get_vocab(self.model)
        cp = llama.llama_context_default_params()
        cp.n_ctx = cells
        cp.n_seq_max = slots
        # Each sequence its own cells (a stream): in one shared buffer, a sequence's attention
        # also runs over other sequences' (masked) cells, and its logits move with them
        # (measured: up to 0.54 here); apart, the same tokens evaluated the same way give the
        # same logits whatever else the model holds.
        cp.kv_unified = False
        # No flash attention: its CPU kernel's numbers for a sequence move with the longest
        # sequence in the batch (measured: the same turn, batched, differs from its first
        # logits on), and here it is the slower path too (SmolLM2, 2 cores, 3,000 tokens of
        # context: 184 against 127-162 prompt tokens/s, 44-56 against 10-18 tokens/s decoded).
        cp.flash_attn_type = llama.LLAMA_FLASH_ATTN_TYPE_DISABLED
        batch = max(batch, PROMPT_CHUNK + slots)  # a step holds a chunk and every decoder
        cp.n_batch = batch
        cp.n_ubatch = batch
        cp.n_threads = threads
        cp.n_threads_batch = threads
        self.ctx = llama.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise OSError(f"llama.cpp could not create a context of {cells} KV cells")
        self.cells = llama.llama_n_ctx(self.ctx)
        self.cells_per_sequence = llama.llama_n_ctx_seq(self.ctx)
        self.slots = slots
        self.batch_size = batch
        self.memory = llama.llama_get_memory(self.ctx)
        self.batch = llama.llama_batch_init(batch, 0, 1)
        self.bytes_per_token = kv_bytes_per_token(llama, self.model)
        import numpy  # llama-cpp-python's own dependency

        self._np = numpy
        self.n_vocab = llama.llama_vocab_n_tokens(self.vocab)
        self._candidates = numpy.zeros(
            self.n_vocab, dtype=numpy.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
        )
        self._candidates["id"] = numpy.arange(self.n_vocab, dtype=numpy.int32)
        self._openers = numpy.array(sorted(openers), dtype=numpy.int64)
        self._blank = blank
        self.stats = RuntimeStats()
        self._read_next = True  # whose turn the next step is, when some decode and one reads
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._jobs: list[Job] = []
        self._thread = threading.Thread(target=self._run, name="rollout-llama", daemon=True)
        self._thread.start()

    # --- the event loop's side ---------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue a job; a thread that stopped (closed, or failed on a bug) ends it at once
        with an error instead of leaving it waiting."""
        if not self._thread.is_alive():
            job.deliver(
                EngineReport(end="error", fed=array("I"), error="the model's thread has stopped")
            )
            return
        self.stats.submitted_prompt += len(job.prompt)
        self._inbox.put(("start", job))

    def cancel(self, job: Job) -> None:
        job.cancelled = True
        self._inbox.put(("wake", None))

    def clear(self, seqs: list[int]) -> None:
        """Drop the KV of these sequences (evicted by the index)."""
        if seqs:
            self._inbox.put(("clear", seqs))

    def close(self) -> None:
        """Stop the thread (running jobs end `cancelled`) and free the context."""
        if self._thread.is_alive():
            self._inbox.put(("stop", None))
            self._thread.join()
        llama = self._llama
        if self.ctx:
            llama.llama_batch_free(self.batch)
            llama.llama_free(self.ctx)
            self.ctx = None

    # --- the thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._commands():
                if self._jobs:
                    self._step()
        except Exception:  # a bug here must not hang the turns waiting on this thread
            log.exception("the llama.cpp thread failed")
            for job in self._jobs:
                self._end(job, "error", "the model's thread failed")
            self._jobs = []

    def _commands(self) -> bool:
        """Apply queued commands (waiting for one when no job runs); False on stop."""
        while True:
            try:
                command, arg = self._inbox.get(block=not self._jobs)
            except queue.Empty:
                break
            if command == "start":
                self._start(arg)
            elif command == "clear":
                for seq in arg:
                    self._llama.llama_memory_seq_rm(self.memory, seq, 0, -1)
            elif command == "stop":
                for job in self._jobs:
                    self._end(job, "cancelled")
                self._jobs = []
                return False
            if not self._jobs and self._inbox.empty():
                continue
        for job in [j for j in self._jobs if j.cancelled]:
            self._end(job, "cancelled")
        self._jobs = [j for j in self._jobs if not j.cancelled]
        return True

    def _start(self, job: Job) -> None:
        llama = self._llama
        for op in job.ops:
            if op[0] == "rm":
                llama.llama_memory_seq_rm(self.memory, op[1], op[2], op[3])
            else:
                llama.llama_memory_seq_cp(self.memory, op[1], op[2], -1, op[3])
        if job.cancelled:
            self._end(job, "cancelled")
            return
        try:
            job.chain = self._sampler(job.sampler)
            if job.sampler.grammar is not None and job.sampler.temperature <= 0:
                job.grammar = job.sampler.grammar.sampler(self.vocab)
        except GrammarError as exc:
            self._end(job, "error", str(exc))
            return
        self._jobs.append(job)

    def _sampler(self, spec: SamplerSpec) -> Any:
        """The job's sampler chain: a grammar first when it has one (unless greedy: see
        `_sample`), then greedy, or top-p, temperature and a seeded draw."""
        llama = self._llama
        chain = llama.llama_sampler_chain_init(llama.llama_sampler_chain_default_params())
        if spec.grammar is not None and spec.temperature > 0:
            llama.llama_sampler_chain_add(chain, spec.grammar.sampler(self.vocab))
        if spec.temperature <= 0:
            llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_greedy())
        else:
            if spec.top_p < 1:
                llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_top_p(spec.top_p, 1))
            llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_temp(spec.temperature))
            llama.llama_sampler_chain_add(
                chain, llama.llama_sampler_init_dist(spec.seed & 0xFFFFFFFF)
            )
        return chain

    def _sample(self, job: Job, index: int) -> int:
        """The job's next token from the logits at batch `index` (`_pick`), the openers masked
        first for a `no_call` job whose output is still blank (in the context's own logits,
        which every sampler reads)."""
        if job.blank and job.sampler.no_call and len(self._openers):
            logits = self._np.ctypeslib.as_array(
                self._llama.llama_get_logits_ith(self.ctx, index), shape=(self.n_vocab,)
            )
            logits[self._openers] = -math.inf
        token = self._pick(job, index)
        if job.blank and token not in self._blank:
            job.blank = False
        return token

    def _pick(self, job: Job, index: int) -> int:
        """The job's next token from the logits at batch `index`. Greedy under a grammar
        checks the best token against the grammar first and applies the grammar to the whole
        vocabulary only when it refuses that token (as llama.cpp's own common sampler does:
        applying it to all ~50k candidates costs several milliseconds a token); the token
        is the same either way (the best one the grammar allows)."""
        llama = self._llama
        if job.grammar is None:
            return int(llama.llama_sampler_sample(job.chain, self.ctx, index))
        logits = self._np.ctypeslib.as_array(
            llama.llama_get_logits_ith(self.ctx, index), shape=(self.n_vocab,)
        )
        best = int(logits.argmax())
        one = (llama.llama_token_data * 1)(llama.llama_token_data(best, float(logits[best]), 0.0))
        single = llama.llama_token_data_array(one, 1, -1, False)
        llama.llama_sampler_apply(job.grammar, ctypes.byref(single))
        if math.isinf(one[0].logit):
            candidates = self._candidates
            candidates["logit"] = logits
            candidates["p"] = 0.0
            data = candidates.ctypes.data_as(ctypes.POINTER(llama.llama_token_data))
            every = llama.llama_token_data_array(data, self.n_vocab, -1, False)
            llama.llama_sampler_apply(job.grammar, ctypes.byref(every))
            best = int(candidates["logit"].argmax())
        llama.llama_sampler_accept(job.grammar, best)
        return best

    def _step(self) -> None:
        llama = self._llama
        batch = self.batch
        n = 0
        outputs: list[tuple[Job, int]] = []  # (job, batch index of its logits)
        evaluated: dict[int, int] = {}
        decoding = [j for j in self._jobs if j.next_token is not None]
        reading = next((j for j in self._jobs if j.read < len(j.prompt)), None)
        # A prompt chunk never shares a step with other sequences' tokens (see "Evaluation
        # boundaries"): while some decode and a prompt waits, steps alternate.
        read = reading is not None and (not decoding or self._read_next)
        self._read_next = not read
        prompt = 0
        if read:
            assert reading is not None
            take = prompt = min(len(reading.prompt) - reading.read, PROMPT_CHUNK)
            for i in range(take):
                index = reading.read + i
                last = index == len(reading.prompt) - 1
                self._put(n, reading.prompt[index], reading.pos + index, reading.seq, last)
                if last:
                    outputs.append((reading, n))
                n += 1
            reading.fed.extend(reading.prompt[reading.read : reading.read + take])
            reading.read += take
            evaluated[id(reading)] = take
            decoding = []
        for job in decoding:
            self._put(n, job.next_token, job.pos + len(job.fed), job.seq, True)  # type: ignore[arg-type]
            job.fed.append(job.next_token)  # type: ignore[arg-type]
            job.next_token = None
            outputs.append((job, n))
            evaluated[id(job)] = 1
            n += 1
        batch.n_tokens = n
        started = time.perf_counter()
        rc = llama.llama_decode(self.ctx, batch)
        if rc != 0:
            self.stats.retired_prompt += prompt
            for job in self._jobs:
                self._end(job, "error", f"llama_decode failed ({rc}): the KV cache is full")
            self._jobs = []
            return
        sampled: dict[int, int] = {}
        for job, index in outputs:
            sampled[id(job)] = self._sample(job, index)
            job.sampled += 1
        self._count(len(decoding), prompt, len(evaluated), time.perf_counter() - started)
        still: list[Job] = []
        for job in self._jobs:
            token = sampled.get(id(job))
            news = EngineReport(
                evaluated=evaluated.get(id(job), 0),
                sampled=(token,) if token is not None else (),
            )
            if token is not None and llama.llama_vocab_is_eog(self.vocab, token):
                job.deliver(news)
                self._end(job, "eog")
            elif token is not None and job.sampled >= job.max_tokens:
                job.deliver(news)
                self._end(job, "length")
            else:
                if token is not None:
                    job.next_token = token
                job.deliver(news)
                still.append(job)
        self._jobs = still
        stats = self.stats
        stats.decoding = sum(1 for j in still if j.next_token is not None)
        stats.prefilling = len(still) - stats.decoding

    def _count(self, decoded: int, prompt: int, sequences: int, seconds: float) -> None:
        stats = self.stats
        stats.steps += 1
        stats.decode_tokens += decoded
        stats.prompt_tokens += prompt
        stats.retired_prompt += prompt
        if prompt:
            stats.prefill_seconds += seconds
        else:
            stats.decode_seconds += seconds
        stats.sequences += sequences
        for i, bound in enumerate(STEP_SEQUENCE_BUCKETS):
            if sequences <= bound:
                stats.step_sequences[i] += 1
                break

    def _put(self, i: int, token: int, pos: int, seq: int, logits: bool) -> None:
        batch = self.batch
        batch.token[i] = token
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = logits

    def _end(self, job: Job, why: str, error: str | None = None) -> None:
        self.stats.retired_prompt += len(job.prompt) - job.read  # what it will not evaluate
        if job.chain is not None:
            self._llama.llama_sampler_free(job.chain)
            job.chain = None
        if job.grammar is not None:
            self._llama.llama_sampler_free(job.grammar)
            job.grammar = None
        job.deliver(EngineReport(end=why, fed=array("I", job.fed), error=error))
