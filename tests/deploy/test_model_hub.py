"""--model Org/Name: a Hugging Face Hub model, read from the Hugging Face cache offline (this machine cannot reach
the Hub, so the cache is laid out from the default model's files); local directories still come first."""

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from flatwire_wire.control import EMPTY
from flatwire_wire.scheduler import SCHEDULER

from harness.procs import ROOT
from services.common.model_store import model_name, resolve_model
from tests.deploy.hub_cache import HUB_MODEL_ID, offline_env, populate_hub_cache


@pytest.fixture(scope="module")
def hf_home(model_dir, tmp_path_factory) -> Path:
    """An HF_HOME whose cache (HF_HOME/hub) holds HUB_MODEL_ID."""
    home = tmp_path_factory.mktemp("hf-home")
    populate_hub_cache(home / "hub", HUB_MODEL_ID, model_dir)
    return home


def _resolve_in(env: dict[str, str], model: str) -> subprocess.CompletedProcess:
    """resolve_model(model) in a fresh interpreter (huggingface_hub reads its variables on import)."""
    code = ("import sys; from services.common.model_store import model_name, resolve_model; "
            "path = resolve_model(sys.argv[1]); print(path); print(model_name(sys.argv[1], path))")
    return subprocess.run([sys.executable, "-c", code, model], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("variable", ["HF_HUB_CACHE", "HF_HOME"])
def test_hub_id_resolves_to_its_cached_snapshot_offline(hf_home, variable):
    env = offline_env(**{variable: str(hf_home / "hub" if variable == "HF_HUB_CACHE" else hf_home)})
    resolved = _resolve_in(env, HUB_MODEL_ID)
    assert resolved.returncode == 0, resolved.stderr
    path, name = resolved.stdout.splitlines()
    repo = hf_home / "hub" / f"models--{HUB_MODEL_ID.replace('/', '--')}"
    assert Path(path) == repo / "snapshots" / (repo / "refs" / "main").read_text()
    assert name == HUB_MODEL_ID


def test_uncached_hub_id_offline_is_a_clear_error(hf_home):
    resolved = _resolve_in(offline_env(HF_HOME=str(hf_home)), "flatwire-test/not-cached")
    assert resolved.returncode != 0
    error = resolved.stderr.strip().splitlines()[-1]
    assert error.startswith("services.common.model_store.ModelNotFound: --model flatwire-test/not-cached: neither a "
                            "local directory nor "
                            f"(completely) in the Hugging Face cache {hf_home / 'hub'}, and this machine is "
                            "offline (HF_HUB_OFFLINE is set)"), resolved.stderr


def test_local_directories_come_first(model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = Path(HUB_MODEL_ID)  # a relative path that reads as a Hub id
    local.mkdir(parents=True)
    (local / "config.json").symlink_to(model_dir / "config.json")
    assert resolve_model(HUB_MODEL_ID) == local
    assert model_name(HUB_MODEL_ID, local) == local.name
    assert model_name(None, model_dir) == model_dir.name
    with pytest.raises(FileNotFoundError, match=r"--model \.: not a Hugging Face checkpoint \(no config\.json\)"):
        resolve_model(".")


def test_neither_a_directory_nor_a_hub_id(tmp_path):
    missing = tmp_path / "no" / "such" / "checkpoint"
    with pytest.raises(FileNotFoundError, match="neither a local directory nor a Hugging Face Hub model id"):
        resolve_model(str(missing))


@pytest.mark.slow
def test_scheduler_serves_a_hub_model_by_its_id(start_service, hf_home):
    _, address = start_service("scheduler", "--model", HUB_MODEL_ID, env=offline_env(HF_HOME=str(hf_home)))
    with grpc.insecure_channel(address) as channel:
        info = SCHEDULER.calls(channel)["GetModelInfo"](EMPTY, timeout=10)
    assert info.model == HUB_MODEL_ID and info.vocab_size > 0
