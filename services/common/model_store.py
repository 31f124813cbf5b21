"""Where a service's model comes from: a local checkpoint, a Hugging Face Hub model, or the embedded default.

flatwire ships no weights. `--model PATH` names any local Hugging Face causal-LM
checkpoint; `--model Org/Name` a Hub model, read from the Hugging Face cache
(HF_HOME, HF_HUB_CACHE) or downloaded into it, as SGLang and vLLM do
(HF_HUB_OFFLINE=1: the cache only). Without it, the embedded default (default_model.py:
the real Qwen3.5 vocabulary, a small random Qwen3 model) is built once, deterministically,
into the cache directory. Both load through the same AutoTokenizer / AutoModelForCausalLM
path as a real checkpoint.
"""

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "flatwire-default-qwen3-v3"  # v2: tools and reasoning in the template; v3: added tokens declared
DEFAULT_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flatwire"



# Weight formats that AutoModelForCausalLM (PyTorch) never loads, left out of a Hub download: some repositories
# carry their weights again in them (original/*.pth, GGUF, ONNX), as large as the weights themselves.
HUB_IGNORE_PATTERNS = ["original/*", "onnx/*", "*.pth", "*.gguf", "*.onnx", "*.h5", "*.msgpack", "*.ot", "*.tflite"]


def cache_root(cache_dir: str | Path | None) -> Path:
    """Where flatwire keeps what it builds (--cache-dir, else DEFAULT_CACHE_DIR)."""
    return Path(cache_dir or DEFAULT_CACHE_DIR)


class ModelNotFound(FileNotFoundError):
    """--model names nothing this machine can load; the message says what it is not."""


def resolve_model(model: str | None, cache_dir: str | Path | None = None) -> Path:
    """The local directory to load from: `model` if it is a local directory, else the Hugging Face Hub
    model of that id (see hub_snapshot); without `model`, the default model, built if needed."""
    if model:
        path = Path(model).expanduser()
        if not path.is_dir():
            return hub_snapshot(model)
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"--model {model}: not a Hugging Face checkpoint (no config.json)")
        return path
    target = cache_root(cache_dir) / DEFAULT_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Three services may start at once: one builds, the others wait on the lock.
    with open(target.parent / f"{DEFAULT_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").is_file():
            build_default_model(target)
    return target


def hub_snapshot(model_id: str) -> Path:
    """The snapshot directory of Hub model `model_id` in the Hugging Face cache, downloaded there if missing
    (with HF_HUB_OFFLINE=1, never: the cache only)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model_id)
    except HFValidationError:
        raise ModelNotFound(
            f"--model {model_id}: neither a local directory nor a Hugging Face Hub model id (Org/Name)") from None
    try:
        return Path(snapshot_download(model_id, ignore_patterns=HUB_IGNORE_PATTERNS))
    except LocalEntryNotFoundError as exc:
        reason = ("this machine is offline (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE
                  else "the Hugging Face Hub could not be reached")
        raise ModelNotFound(
            f"--model {model_id}: neither a local directory nor (completely) in the Hugging Face cache "
            f"{constants.HF_HUB_CACHE}, and {reason}: {exc}") from exc
    except HfHubHTTPError as exc:  # no such model, or a gated or private one (a token: HF_TOKEN)
        raise ModelNotFound(
            f"--model {model_id}: not a local directory, and the Hugging Face Hub refused it: {exc}") from exc


def model_name(model: str | None, model_dir: Path) -> str:
    """What clients call the model: a Hub model by its id, as given (as vLLM and SGLang name it; its
    directory is a commit hash); any other by its checkpoint directory's name, never its path."""
    if model and not Path(model).expanduser().is_dir():
        return model
    return model_dir.resolve().name or "model"


def progress(message: str) -> None:
    """A line on stderr about building the default model."""
    print(f"[flatwire] {message}", file=sys.stderr, flush=True)


def build_default_model(target: Path) -> None:
    """Build the default model (services/common/default_model.py) in a child process, then move it to `target`.
    Ctrl-C meanwhile (KeyboardInterrupt here, in the wait) stops the child and leaves nothing half-built."""
    progress(f"building the default model into {target} (once)")
    with tempfile.TemporaryDirectory(dir=target.parent) as staging:
        staging_dir = Path(staging) / "model"
        # SIGINT ignored: a terminal's Ctrl-C reaches the whole process group, and this process stops the build.
        child = subprocess.Popen([sys.executable, "-m", "services.common.default_model", str(staging_dir)],
                                 preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        try:
            code = child.wait()
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        if code != 0:
            raise RuntimeError(f"building the default model failed (exit code {code}); its output is above")
        shutil.rmtree(target, ignore_errors=True)
        staging_dir.rename(target)
    progress("default model ready")
