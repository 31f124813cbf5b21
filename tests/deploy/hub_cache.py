"""A Hugging Face cache holding a Hub model, laid out offline from a local checkpoint (the tests never reach
the Hub)."""

import hashlib
import os
from pathlib import Path

HUB_MODEL_ID = "flatwire-test/tiny-qwen3"
HF_CACHE_VARIABLES = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def populate_hub_cache(hub_cache: Path, model_id: str, checkpoint: Path) -> Path:
    """Lay out `model_id` in `hub_cache` as huggingface_hub does (models--Org--Name/refs/main names the commit,
    snapshots/<commit>/ holds its files), the files linked to the checkpoint's; the snapshot directory."""
    repo = hub_cache / ("models--" + model_id.replace("/", "--"))
    commit = hashlib.sha1(model_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in checkpoint.iterdir():
        (snapshot / file.name).symlink_to(file)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def offline_env(**cache_variables: str) -> dict[str, str]:
    """This process's environment, offline, its Hugging Face cache set by these variables alone (HF_HUB_CACHE,
    or HF_HOME: HF_HOME/hub)."""
    env = {name: value for name, value in os.environ.items() if name not in HF_CACHE_VARIABLES}
    return {**env, **cache_variables, "HF_HUB_OFFLINE": "1"}
