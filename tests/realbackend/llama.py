"""llama.cpp's llama-server as a real process for the real-backend suite, and statestore in front of it.

The binary and the model come from scripts/real-backend.sh (built once, cached in ~/.cache/statestore/); when they
cannot be built the suite fails, naming the script's own words: never a skip."""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.server import REPO, free_port

SCRIPT = REPO / "scripts" / "real-backend.sh"
MODEL_NAME = "tiny-qwen2"
# The sampling every request of the suite uses, so a reply is a function of its prompt.
GREEDY: dict[str, Any] = {"temperature": 0, "top_k": 1, "seed": 7}


@dataclass(frozen=True)
class Artifacts:
    binary: Path
    model: Path


def build() -> Artifacts:
    """The binary and model, built (or found in the cache) by scripts/real-backend.sh."""
    python = REPO / ".venv" / "bin" / "python"
    done = subprocess.run(
        [str(SCRIPT), str(python if python.exists() else "python3")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(f"scripts/real-backend.sh could not build the real backend:\n{done.stderr[-4000:]}", pytrace=False)
    binary, model = done.stdout.strip().splitlines()[-2:]
    return Artifacts(Path(binary), Path(model))


class LlamaServer:
    """One llama-server process with one slot of `context` tokens, greedy by default. Its prompt is evaluated a token
    at a time (`-ub 1`): the numbers then do not depend on how much of a prompt the cache held, so a reply is the same
    bytes whichever request filled the cache before it (random weights leave near-ties that another batching flips)."""

    def __init__(self, artifacts: Artifacts, *, context: int, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.context = context
        self.log_path = log_dir / f"llama-server-{self.port}.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [str(artifacts.binary), "-m", str(artifacts.model), "--host", "127.0.0.1", "--port", str(self.port),
             "-c", str(context), "-np", "1", "--jinja", "--alias", MODEL_NAME, "--temp", "0", "--seed", "7",
             "-t", "1", "--no-webui", "-ub", "1"],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "LLAMA_ARG_HOST": "127.0.0.1"},
        )  # fmt: skip
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"llama-server did not become ready in {timeout}s:\n{self.log()[-3000:]}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
