"""What the service refuses: requests without a valid key where keys are set, another key's clients, states and
futures, a non-loopback bind without a key, and malformed requests (a 4xx with the reason, nothing changed)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import tinker
from tinker import types

from rlplat_tinker.serve import start

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def keyed(model_dir, tmp_path_factory):
    with start(model_dir, keys=["tml-alice", "tml-bob"], state_dir=str(tmp_path_factory.mktemp("states"))) as service:
        yield service


def post(base_url: str, path: str, body, key: str | None = "tml-alice", content_type: str = "application/json") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": content_type, **({"X-API-Key": key} if key else {})}
    request = urllib.request.Request(base_url + path, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def result(base_url: str, request_id: str, key: str = "tml-alice") -> dict:
    while True:
        status, body = post(base_url, "/api/v1/retrieve_future", {"request_id": request_id}, key)
        if status != 408:
            return body


def test_a_request_without_a_valid_key_is_refused(keyed):
    for key in (None, "tml-mallory"):
        status, body = post(keyed.base_url, "/api/v1/create_session", {}, key)
        assert status == 401 and "X-API-Key" in body["detail"]


def test_another_keys_client_state_and_futures_are_not_found(keyed):
    with tinker.ServiceClient(base_url=keyed.base_url, api_key="tml-alice") as alice:
        saved = alice.create_lora_training_client(base_model=keyed.service.base_model, rank=2).result().save_state("mine").result().path
    model_id = saved.split("/")[2]
    status, submitted = post(keyed.base_url, "/api/v1/save_weights", {"model_id": model_id, "path": "x"}, "tml-alice")
    assert status == 200
    for path, body in (("/api/v1/get_info", {"model_id": model_id}),
                       ("/api/v1/optim_step", {"model_id": model_id, "adam_params": {"learning_rate": 1.0}}),
                       ("/api/v1/save_weights", {"model_id": model_id, "path": "theirs"}),
                       ("/api/v1/retrieve_future", {"request_id": submitted["request_id"]})):
        status, answer = post(keyed.base_url, path, body, "tml-bob")
        assert status == 404 and "no " in answer["detail"], (path, status, answer)
    session = post(keyed.base_url, "/api/v1/create_session", {}, "tml-bob")[1]["session_id"]
    status, answer = post(keyed.base_url, "/api/v1/load_weights",
                          {"session_id": session, "model_seq_id": 0, "path": saved, "optimizer": True}, "tml-bob")
    assert status == 404 and "no saved state" in answer["detail"]
    with tinker.ServiceClient(base_url=keyed.base_url, api_key="tml-bob") as bob:
        with pytest.raises(Exception, match="no saved state"):
            bob.create_training_client_from_state(saved).result()


def test_binding_beyond_loopback_needs_a_key(model_dir):
    with pytest.raises(ValueError, match="needs an API key"):
        start(model_dir, host="0.0.0.0")
    with pytest.raises(ValueError, match="start with 'tml-'"):
        start(model_dir, keys=["secret"])


def test_bad_requests_get_a_4xx_with_the_reason_and_change_nothing(keyed):
    with tinker.ServiceClient(base_url=keyed.base_url, api_key="tml-alice") as alice:
        check_bad_requests(keyed, alice.create_lora_training_client(base_model=keyed.service.base_model, rank=2).result())


def session(keyed) -> str:
    return post(keyed.base_url, "/api/v1/create_session", {}, "tml-alice")[1]["session_id"]


def check_bad_requests(keyed, client) -> None:
    model_id = client.model_id
    probe = [types.Datum(model_input=types.ModelInput.from_ints([1, 5, 6]), loss_fn_inputs={"target_tokens": [5, 6, 7], "weights": [1.0] * 3})]
    before = client.forward(probe, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    cases = [
        ("/api/v1/forward_backward", b"not a protobuf", "application/x-protobuf", 400, "not a ForwardBackwardRequest"),
        ("/api/v1/optim_step", {"model_id": model_id, "adam_params": {"learning_rate": -1.0}}, "application/json", 400, "lr must be"),
        ("/api/v1/optim_step", {"model_id": model_id, "adam_params": {"learning_rate": 1e-3, "momentum": 0.9}}, "application/json", 400, "momentum"),
        ("/api/v1/save_weights", {"model_id": model_id, "path": "../escape"}, "application/json", 400, "must be a name"),
        ("/api/v1/load_weights", {"model_id": model_id, "path": "/etc/passwd"}, "application/json", 400, "is not tinker://"),
        ("/api/v1/create_model", {"session_id": "nope", "lora_config": {"rank": 2}}, "application/json", 404, "no session"),
        ("/api/v1/asample", {"sampling_session_id": "nope", "prompt": {"chunks": []}}, "application/json", 404, "no sampling session"),
        ("/api/v1/get_info", [1, 2], "application/json", 400, "not a JSON object"),
        # fields of the wrong type or shape: 400 with the reason, not a 500 the SDK retries for minutes
        ("/api/v1/get_info", {"model_id": ["a list"]}, "application/json", 400, "malformed request"),
        ("/api/v1/create_model", {"session_id": {"a": 1}}, "application/json", 400, "malformed request"),
        ("/api/v1/retrieve_future", {"request_id": [1]}, "application/json", 400, "malformed request"),
        ("/api/v1/create_model", {"session_id": session(keyed), "lora_config": "rank 2"}, "application/json", 400, "malformed request"),
        # ids become folder names: only integers
        ("/api/v1/create_model", {"session_id": session(keyed), "model_seq_id": "x/../../../../tmp/out", "lora_config": {"rank": 2}},
         "application/json", 400, "model_seq_id must be an integer"),
        ("/api/v1/load_weights", {"session_id": session(keyed), "path": "tinker://../weights/x"}, "application/json", 404, "no saved state"),
    ]
    for path, body, content_type, expected, reason in cases:
        status, answer = post(keyed.base_url, path, body, "tml-alice", content_type)
        assert status == expected and reason in answer["detail"], (path, status, answer)
    with pytest.raises(Exception, match="unknown loss_fn"):
        client.forward_backward(probe, "dpo").result()
    with pytest.raises(Exception, match="outside the vocabulary"):
        client.forward_backward([types.Datum(model_input=types.ModelInput.from_ints([1, 500]),
                                             loss_fn_inputs={"target_tokens": [5, 6], "weights": [1.0, 1.0]})], "cross_entropy").result()
    with pytest.raises(Exception, match="lacks 'advantages'"):
        client.forward_backward([types.Datum(model_input=types.ModelInput.from_ints([1, 5]),
                                             loss_fn_inputs={"target_tokens": [5, 6], "logprobs": [0.0, 0.0]})], "ppo").result()
    with pytest.raises(Exception, match="needs loss_fn_config"):
        client.forward_backward(probe, "dro").result()
    with pytest.raises(Exception, match="exists for"):  # a 400 at once (a 409 the SDK would retry for minutes)
        client.save_state("twice").result()
        client.save_state("twice").result()
    sampler = client.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([1, 5, 6])
    for tokens, reason in (([1, 500], "outside the vocabulary"), ([1, -3], "outside the vocabulary")):
        with pytest.raises(Exception, match=reason):
            sampler.sample(prompt=types.ModelInput.from_ints(tokens), num_samples=1, sampling_params=types.SamplingParams(max_tokens=2)).result()
    with pytest.raises(Exception, match="exceed the model's context"):
        sampler.sample(prompt=prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=10**6)).result()
    with pytest.raises(Exception, match="num_samples must be"):
        sampler.sample(prompt=prompt, num_samples=10**6, sampling_params=types.SamplingParams(max_tokens=2)).result()
    assert client.forward(probe, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist() == before


def test_a_saved_state_records_a_hash_of_its_owners_key_not_the_key(keyed):
    with tinker.ServiceClient(base_url=keyed.base_url, api_key="tml-alice") as alice:
        client = alice.create_lora_training_client(base_model=keyed.service.base_model, rank=2).result()
        client.save_state("owned").result()
    owners = [path.read_text() for path in keyed.state_dir.rglob("OWNER")]
    assert owners and not any("tml-alice" in owner for owner in owners)
