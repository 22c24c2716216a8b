"""llama-cpp-python's own OpenAI-compatible server (`python -m llama_cpp.server`, its `[server]`
extra), as users run it in front of a GGUF model: measured beside rollout's embedded engine
(`--scenario real-model-batch`) and tested behind `rollout serve`
(tests/test_llama_server_upstream.py).

One thing is changed around the server, not in it: the model's weights are not repacked into
extra buffer types (`use_extra_bufts`, the engine's own `model_params()` choice): where the CPU
advertises AMX and the hypervisor has not enabled its tile state (the virtual machines this
project runs on), those kernels fault (SIGILL in `llama_decode`). `LAUNCH` patches llama.cpp's
default model parameters, then runs the server's `__main__` as `python -m` would.
"""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import trio

from ._errors import BenchError
from ._server import free_port, stop_process

__all__ = ["LAUNCH", "llama_server_missing", "open_llama_server"]

LAUNCH = """
import runpy, llama_cpp.llama_cpp as api
_default = api.llama_model_default_params
def _params():
    params = _default()
    params.use_extra_bufts = False
    return params
api.llama_model_default_params = _params
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
"""
# Seconds for the server to load the model and answer GET /v1/models.
START_TIMEOUT = 120.0


def llama_server_missing() -> str | None:
    """None when `python -m llama_cpp.server` can run here, else why not."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install 'rollout-engine[llama]')"
    if importlib.util.find_spec("llama_cpp.server.app") is None or (
        importlib.util.find_spec("uvicorn") is None
    ):
        return (
            "llama-cpp-python's [server] extra is not installed "
            "(pip install 'llama-cpp-python[server]')"
        )
    return None


@asynccontextmanager
async def open_llama_server(
    model: Path,
    *,
    alias: str,
    threads: int,
    n_ctx: int,
    extra_args: Sequence[str] = (),
    log_path: Path | None = None,
    port: int | None = None,
) -> AsyncIterator[str]:
    """Start the server on loopback with `model` served as `alias`; yield its base URL
    (`http://127.0.0.1:PORT/v1`) once it answers; stop it (terminate, then kill)."""
    missing = llama_server_missing()
    if missing is not None:
        raise BenchError(missing)
    port = port or free_port()
    argv = [
        sys.executable, "-c", LAUNCH, "--model", str(model), "--model_alias", alias,
        "--n_ctx", str(n_ctx), "--n_threads", str(threads), "--host", "127.0.0.1",
        "--port", str(port), *extra_args,
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1"
    with contextlib.ExitStack() as files:
        log = files.enter_context(log_path.open("wb")) if log_path else subprocess.DEVNULL
        process = await trio.lowlevel.open_process(
            argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            with trio.fail_after(START_TIMEOUT):
                async with httpx.AsyncClient() as client:
                    while True:
                        if process.poll() is not None:
                            raise BenchError(
                                f"llama_cpp.server exited ({process.returncode}) before it "
                                "answered" + (f"; see {log_path}" if log_path else "")
                            )
                        try:
                            if (await client.get(f"{url}/models")).status_code == 200:
                                break
                        except httpx.HTTPError:
                            pass
                        await trio.sleep(0.2)
            yield url
        finally:
            await stop_process(process)
