"""LoRA adapters through the whole pipeline (issue 50): SGLang's and vLLM's routes load and unload them (admin),
`/generate` runs one by lora_path, the `openai` client by its name as the model (listed in /v1/models with vLLM's
parent and root), and cache_salt isolates prefix-cache entries. Adapters are made by PEFT on the default model;
greedy outputs are checked against PEFT's merge of each into the weights, run by transformers. vLLM's token route,
/inference/v1/generate, runs an adapter named as its model, as SkyRL sends it."""

import base64
import pickle

import httpx
import numpy as np
import openai
import pytest
import torch

from harness.http import post
from harness.stack import running
from tests.scheduler.lora_adapters import merged, peft_adapter

pytestmark = pytest.mark.slow
ADMIN_KEY = "admin-lora"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
NEW_TOKENS = 8
PROMPT = np.random.default_rng(50).integers(0, 240_000, 12).tolist()


@pytest.fixture(scope="module")
def adapter_dirs(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"start": peft_adapter(model_dir, root / "start", 1, 8, 16, ["q_proj", "v_proj", "down_proj"]),
            "other": peft_adapter(model_dir, root / "other", 2, 4, 8, ["o_proj", "gate_proj", "up_proj"]),
            "rslora": peft_adapter(model_dir, root / "rslora", 3, 16, 8, ["k_proj", "o_proj"], use_rslora=True)}


@pytest.fixture(scope="module")
def greedy(model_dir, adapter_dirs):
    """Adapter name -> PEFT's merge's greedy tokens for PROMPT (None: the base model's)."""
    expected = {}
    for name in [None, *adapter_dirs]:
        model = merged(model_dir, adapter_dirs[name]) if name else None
        if model is None:
            from transformers import AutoModelForCausalLM
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False)
        expected[name] = out[0, len(PROMPT):].tolist()
    assert len({tuple(tokens) for tokens in expected.values()}) == len(expected), "each adapter changes the output"
    return expected


@pytest.fixture(scope="module")
def lora_stack(model_dir, log_dir, adapter_dirs):
    with running(model_dir, log_dir, scheduler_args=("--lora-paths", f"start={adapter_dirs['start']}",
                                                     "--max-loras-per-batch", "2", "--max-lora-rank", "16"),
                 gateway_env={"FLATWIRE_ADMIN_API_KEY": ADMIN_KEY}) as stack:
        stack.wait_ready()
        yield stack


@pytest.fixture(scope="module")
def http(lora_stack):
    with httpx.Client(base_url=lora_stack.http_url, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def client(lora_stack):
    with openai.OpenAI(base_url=lora_stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def generate(http, lora_path, prompt=PROMPT) -> dict:
    response = post(http, "/generate", {"input_ids": prompt, "lora_path": lora_path,
                                        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0,
                                                            "ignore_eos": True}})
    assert response.status_code == 200, response.text
    return response.json()


def test_the_openai_client_runs_an_adapter_named_as_the_model(client, greedy):
    cards = {card.id: card for card in client.models.list().data}
    [base] = [name for name, card in cards.items() if card.model_extra.get("parent") is None]
    assert cards["start"].model_extra["parent"] == base and cards["start"].model_extra["root"] == "start"
    assert client.models.retrieve("start").id == "start"
    for model in ("start", f"{base}:start"):  # vLLM's way, SGLang's
        reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                          extra_body={"return_token_ids": True, "ignore_eos": True})
        assert reply.choices[0].model_extra["token_ids"] == greedy["start"]
        assert reply.model == model
    chat = client.chat.completions.create(model="start", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert chat.model == "start" and chat.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="nobody", prompt=PROMPT, max_tokens=2)
    assert missing.value.body["param"] == "model" and "`nobody` does not exist" in missing.value.body["message"]


def test_vllm_token_route_runs_the_adapter_its_model_names(http, greedy):
    """/inference/v1/generate as SkyRL's _generate_single sends it with LoRA (RemoteInferenceClient._resolve_model:
    the adapter's name as `model`): the adapter's tokens; the base model's by its name; an adapter not loaded 404."""
    base = http.get("/v1/models").json()["data"][0]["id"]
    for model, expected in (("start", greedy["start"]), (base, greedy[None])):
        reply = post(http, "/inference/v1/generate", {"model": model, "token_ids": PROMPT, "sampling_params": {
            "max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True, "logprobs": 0}})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["token_ids"] == expected and reply.json()["model"] == model
    missing = post(http, "/inference/v1/generate", {"model": "nobody", "token_ids": PROMPT,
                                                     "sampling_params": {"max_tokens": 2}})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_sglang_routes_load_and_unload_an_adapter_by_path(http, adapter_dirs, greedy):
    path = str(adapter_dirs["other"])
    refused = post(http, "/load_lora_adapter", {"lora_name": "dyn", "lora_path": path})
    assert refused.status_code == 401  # an admin route
    loaded = post(http, "/load_lora_adapter", {"lora_name": "dyn", "lora_path": path}, headers=ADMIN)
    assert loaded.status_code == 200, loaded.text
    body = loaded.json()
    assert body["success"] and body["error_message"] is None
    assert body["loaded_adapters"]["dyn"] == {"lora_id": None, "lora_name": "dyn", "lora_path": path, "pinned": False}
    again = post(http, "/load_lora_adapter", {"lora_name": "dyn", "lora_path": path}, headers=ADMIN)
    assert again.status_code == 400 and "already loaded" in again.json()["error_message"]
    assert generate(http, "dyn")["output_ids"] == greedy["other"]
    batch = post(http, "/generate", {"input_ids": [PROMPT, PROMPT, PROMPT], "lora_path": ["dyn", None, "start"],
                                     "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0,
                                                         "ignore_eos": True}}).json()
    assert [one["output_ids"] for one in batch] == [greedy["other"], greedy[None], greedy["start"]]
    unloaded = post(http, "/unload_lora_adapter", {"lora_name": "dyn"}, headers=ADMIN)
    assert unloaded.status_code == 200 and "dyn" not in unloaded.json()["loaded_adapters"]
    gone = post(http, "/generate", {"input_ids": PROMPT, "lora_path": "dyn", "sampling_params": {"max_new_tokens": 2}})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_path"
    missing = post(http, "/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"}, headers=ADMIN)
    assert missing.status_code == 400 and "No adapter found at /nowhere" in missing.json()["error_message"]


def test_an_adapter_from_its_safetensors_bytes_and_never_from_a_pickle(http, adapter_dirs, greedy):
    import json
    directory = adapter_dirs["rslora"]
    config = json.loads((directory / "adapter_config.json").read_text())
    data = base64.b64encode((directory / "adapter_model.safetensors").read_bytes()).decode()
    body = {"lora_name": "sent", "config_dict": config, "serialized_tensors": data, "load_format": "safetensors"}
    loaded = post(http, "/load_lora_adapter_from_tensors", body, headers=ADMIN)
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["loaded_adapters"]["sent"]["lora_path"] == "__tensor__"
    assert generate(http, "sent")["output_ids"] == greedy["rslora"]
    assert post(http, "/unload_lora_adapter", {"lora_name": "sent"}, headers=ADMIN).status_code == 200
    pickled = base64.b64encode(pickle.dumps({"flattened_tensor": None, "metadata": []})).decode()
    for load_format in (None, "flattened_bucket"):  # what miles and AReaL send
        refused = post(http, "/load_lora_adapter_from_tensors", {**body, "serialized_tensors": pickled,
                                                                 "load_format": load_format}, headers=ADMIN)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "serialized_tensors"
        assert "unpickling" in refused.json()["error"]["message"]


def test_vllm_routes_load_replace_in_place_and_unload(http, adapter_dirs, greedy):
    load = {"lora_name": "v", "lora_path": str(adapter_dirs["other"])}
    assert post(http, "/v1/load_lora_adapter", load).status_code == 401
    ok = post(http, "/v1/load_lora_adapter", load, headers=ADMIN)
    assert ok.status_code == 200 and ok.text == "Success: LoRA adapter 'v' added successfully."
    assert generate(http, "v")["output_ids"] == greedy["other"]
    twice = post(http, "/v1/load_lora_adapter", load, headers=ADMIN)
    assert twice.status_code == 400 and "already loaded" in twice.json()["error"]["message"]
    replaced = post(http, "/v1/load_lora_adapter", {**load, "lora_path": str(adapter_dirs["rslora"]),
                                                    "load_inplace": True}, headers=ADMIN)
    assert replaced.status_code == 200, replaced.text
    after = generate(http, "v")
    assert after["output_ids"] == greedy["rslora"]
    assert after["meta_info"]["cached_tokens"] == 0  # the old weights' pages serve nobody
    gone = post(http, "/v1/unload_lora_adapter", {"lora_name": "v"}, headers=ADMIN)
    assert gone.status_code == 200 and gone.text == "Success: LoRA adapter 'v' removed successfully."
    again = post(http, "/v1/unload_lora_adapter", {"lora_name": "v"}, headers=ADMIN)
    assert again.status_code == 404 and "cannot be found" in again.json()["error"]["message"]
    nowhere = post(http, "/v1/load_lora_adapter", {"lora_name": "w", "lora_path": "/nowhere"}, headers=ADMIN)
    assert nowhere.status_code == 404


def test_cache_salt_isolates_prefix_cache_entries(client, lora_stack):
    [base] = [card.id for card in client.models.list().data if card.model_extra.get("parent") is None]
    prompt = np.random.default_rng(51).integers(0, 240_000, 40).tolist()

    def cached(model: str, salt: str | None) -> int:
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=1,
                                          extra_body={"cache_salt": salt} if salt is not None else None)
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached(base, "alice") == 0
    assert cached(base, "alice") == 32  # two whole pages of 16
    assert cached(base, "bob") == 0
    assert cached(base, None) == 0
    assert cached("start", "alice") == 0  # the same salt on an adapter: its own entries
    assert cached("start", "alice") == 32
