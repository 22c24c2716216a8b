"""Many rollouts, one model (`engine/_llama_engine.py`): batched with others, a turn computes
exactly what it computes alone, and the model's thread keeps its scheduling policy.

Why "exactly" holds, not only "usually": llama.cpp's numbers for a sequence depend on how that
sequence's own tokens are grouped into evaluations (a prompt read in 64-token chunks gives
logits up to ~0.8 away from 128-token ones), and on a prompt chunk's company in a batch (beside
other sequences' tokens it can come out ~0.5 away; flash attention moves with the batch's
longest sequence), not on single tokens of other sequences decoded beside it (each sequence
has its own KV cells, `kv_unified = False`). The engine turns flash attention off, cuts every
prompt at the same places (`PROMPT_CHUNK` tokens from its first position) and reads each chunk
alone; decoding tokens, one per sequence, are batched. So:

- on the model's thread, a job's logits, bit for bit, are the same alone and beside a job that
  decodes while it reads its prompt, and the policy holds: the prompt in the same chunks, the
  decoder waiting one step at a time. Cutting a prompt by what a step has left (the policy
  before) fails it: alone the prompt was one evaluation, beside a decoder three;
- through the server, three forced tool loops run at once (each under its own API key: the
  KV index is per owner) produce the same items and usage as one alone, their turns batched
  (more than one sequence per step), and the model reads three times what one reads alone:
  nothing evaluated again. Evaluating a prompt's chunk in the same step as the others'
  decoding tokens (the policy before) fails it: two of the three answers came out otherwise.

Each test needs the llama extra; without it they skip (and fail under ROLLOUT_REQUIRE_ALL).
"""

from __future__ import annotations

import hashlib
from array import array
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from tests.llama_harness import require_llama, smollm2_vocab
from tests.server_harness import open_test_server
from tests.test_llama_modes import Outcome, Script, run_rollout

DEADLINE = 300
PROMPT = (
    "Read the failing test, then the module it imports, and explain the bug in a few words. " * 14
)  # ~280 tokens: two chunks and a rest
OTHER = "Count from one to one hundred, in words, separated by commas."


@attrs.define
class Trace:
    """A job's news: per step, tokens evaluated and sampled, and its logits' digests."""

    steps: list[tuple[int, tuple[int, ...]]] = attrs.field(factory=list)
    digests: list[str] = attrs.field(factory=list)
    ended: trio.Event = attrs.field(factory=trio.Event)
    first: trio.Event = attrs.field(factory=trio.Event)

    @property
    def tokens(self) -> list[int]:
        return [t for _, sampled in self.steps for t in sampled]


def open_runtime(model: Any, digests: dict[int, list[str]]) -> Any:
    """The engine's runtime, recording each sampled position's logits (their SHA-256)."""
    from rollout.engine._llama_engine import LlamaRuntime

    class Recording(LlamaRuntime):
        def _pick(self, job: Any, index: int) -> int:
            logits = self._np.ctypeslib.as_array(
                self._llama.llama_get_logits_ith(self.ctx, index), shape=(self.n_vocab,)
            )
            digests.setdefault(job.seq, []).append(hashlib.sha256(logits.tobytes()).hexdigest())
            return super()._pick(job, index)

    return Recording(model, cells=4 * 1024, slots=4, threads=2, batch=512)


def job(seq: int, tokens: list[int], max_tokens: int, trace: Trace) -> Any:
    from rollout.engine._llama_engine import EngineReport, Job, SamplerSpec

    def report(news: EngineReport) -> None:
        trace.steps.append((news.evaluated, news.sampled))
        if news.sampled:
            trace.first.set()
        if news.end is not None:
            trace.ended.set()

    return Job(
        seq=seq,
        ops=[],
        prompt=array("I", tokens),
        pos=0,
        sampler=SamplerSpec(),
        max_tokens=max_tokens,
        report=report,
        token=trio.lowlevel.current_trio_token(),
    )


async def test_a_turn_computes_the_same_logits_alone_and_beside_a_decoding_turn() -> None:
    require_llama()
    from rollout.engine._llama import _load_model
    from rollout.engine._llama_engine import PROMPT_CHUNK
    from rollout.engine._llama_vocab import packaged_smollm2

    vocab = smollm2_vocab()
    prompt, other = list(vocab.encode(PROMPT)), list(vocab.encode(OTHER))
    assert 2 * PROMPT_CHUNK < len(prompt) < 3 * PROMPT_CHUNK
    path = packaged_smollm2()
    assert path is not None
    model = _load_model(path)
    digests: dict[int, list[str]] = {}
    runtime = open_runtime(model, digests)
    try:
        with trio.fail_after(DEADLINE):
            alone = Trace()
            runtime.submit(job(0, prompt, 12, alone))
            await alone.ended.wait()
            decoder, beside = Trace(), Trace()
            runtime.submit(job(1, other, 80, decoder))
            await decoder.first.wait()  # it decodes from now on
            runtime.submit(job(2, prompt, 12, beside))
            await beside.ended.wait()
            await decoder.ended.wait()
    finally:
        await trio.to_thread.run_sync(runtime.close)
        import llama_cpp

        llama_cpp.llama_model_free(model)
    # Alone, the prompt is read in chunks of PROMPT_CHUNK, one per step; beside a decoder, too.
    chunks = [e for e, _ in beside.steps if e > 1]
    assert chunks == [PROMPT_CHUNK, PROMPT_CHUNK, len(prompt) - 2 * PROMPT_CHUNK], beside.steps
    assert [e for e, _ in alone.steps if e > 1] == chunks
    # While the other read its prompt, the decoder waited one step at a time (steps alternate).
    waits = "".join("." if sampled else "w" for _, sampled in decoder.steps)
    assert "w" in waits and "ww" not in waits, waits
    assert beside.tokens == alone.tokens and len(alone.tokens) >= 12
    assert digests[2] == digests[0], "batched, the turn's logits differ from its logits alone"


def model_work(text: str) -> dict[str, float]:
    work = {"prompt": 0.0, "steps": 0.0, "sequences": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "rollout_model_tokens_total" and sample.labels["kind"] == "prompt":
                work["prompt"] += sample.value
            elif sample.name == "rollout_model_steps_total":
                work["steps"] += sample.value
            elif sample.name == "rollout_model_step_sequences_sum":
                work["sequences"] += sample.value
    return work


async def scrape(url: str, key: str) -> dict[str, float]:
    root = url.removesuffix("/v1")
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}) as client:
        response = await client.get(f"{root}/metrics")
    assert response.status_code == 200, response.text
    return model_work(response.text)


async def test_rollouts_batched_sample_and_read_what_each_does_alone(tmp_path: Path) -> None:
    require_llama()
    script = Script(calls=2, max_output_tokens=48)
    keys = [f"sk-agent-{i}" for i in range(4)]
    with trio.fail_after(DEADLINE):
        async with open_test_server(tmp_path, api_keys=tuple(keys)) as url:
            before = await scrape(url, keys[0])
            alone = Outcome(mode=keys[0], script=script)
            await run_rollout(url, alone, key=keys[0])
            between = await scrape(url, keys[0])
            together = [Outcome(mode=key, script=script) for key in keys[1:]]
            async with trio.open_nursery() as nursery:
                for outcome in together:
                    nursery.start_soon(run_rollout, url, outcome, outcome.mode)
            after = await scrape(url, keys[0])
    one = between["prompt"] - before["prompt"]
    assert len([i for i in alone.items if i["type"] == "function_call"]) == script.calls
    for outcome in together:
        assert outcome.items == alone.items, (outcome.items, alone.items)
        assert outcome.input_tokens == alone.input_tokens
        assert outcome.output_tokens == alone.output_tokens
    assert after["prompt"] - between["prompt"] == 3 * one, (one, after, between)
    # They were batched: more than one sequence per step, on average.
    steps = after["steps"] - between["steps"]
    assert (after["sequences"] - between["sequences"]) / steps > 1.5, (after, between)


async def test_a_turn_waits_while_the_prompt_queue_is_full() -> None:
    """`prefill_queue_tokens`: past it, a new turn waits (before it takes KV) until the
    queued prompt tokens drain below it; both turns then finish. With the default bound, the
    same two turns are both admitted at once."""
    require_llama()
    from rollout.engine._llama import LlamaBackend

    from tests.test_llama_backend import create, engine_with, registry

    long = "Summarize this: " + "the quick brown fox jumps over the lazy dog. " * 60  # ~600
    for bound, waits in ((64, 1), (8192, 0)):
        reg = registry(context=2048, sequences=3)
        backend = reg.resolve("small").backend
        assert isinstance(backend, LlamaBackend)
        backend.config = attrs.evolve(backend.config, prefill_queue_tokens=bound)
        with trio.fail_after(DEADLINE):
            async with engine_with(reg) as engine, trio.open_nursery() as nursery:
                await backend.start()  # the model loaded: the turns below start at once
                for text in (long, "Say hi."):  # the long one first: on the thread, reading
                    request = create(text, tools=[], max_output_tokens=4)
                    nursery.start_soon(engine.session(owner=text[:8]).respond, request)
                    await trio.testing.wait_all_tasks_blocked()
                assert backend.waiting == waits, (bound, backend.waiting)
                stats = backend.runtime_stats
                assert stats is not None and stats.queued_prompt > bound * waits
        assert backend.waiting == 0
