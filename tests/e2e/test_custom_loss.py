"""Custom losses: forward_backward_custom runs client-side in the SDK's
two cross_entropy phases; server-side custom losses are refused, naming that alternative."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

API_KEY = "tml-test"
TOKENS = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]


def _datum() -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]), loss_fn_inputs={"target_tokens": TOKENS[1:]}
    )


def squared_logprobs(data: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """C = Σ lp²: its gradient in lp is 2·lp."""
    loss = sum((lp**2).sum() for lp in logprobs)
    return loss, {"custom/tokens:sum": float(sum(lp.numel() for lp in logprobs))}


@pytest.fixture(scope="module")
def service(shared_daemon):
    client = tinker.ServiceClient(base_url=shared_daemon.url, api_key=API_KEY)
    yield client
    client.close("success").result()


def test_forward_backward_custom_reports_the_loss_and_the_surrogate(service):
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=0).result()
    lp = np.asarray(training.forward([_datum()], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist())
    result = training.forward_backward_custom([_datum()], squared_logprobs).result()
    c = float(np.sum(lp.astype(np.float64) ** 2))
    # Phase 2 sends weights w = −∂C/∂lp = −2·lp, so the server's surrogate −Σ w·lp is 2·C.
    assert result.metrics["loss:sum"] == pytest.approx(c, rel=1e-5)
    assert result.metrics["surrogate_loss:sum"] == pytest.approx(2 * c, rel=1e-5)
    assert result.metrics["custom/tokens:sum"] == len(TOKENS) - 1


def test_forward_backward_custom_gives_the_gradient_of_the_custom_loss(service):
    """The same step from the equivalent built-in call (cross_entropy, weights −2·lp) has the same grad norm."""
    custom = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=1).result()
    builtin = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=1).result()
    custom.forward_backward_custom([_datum()], squared_logprobs).result()
    lp = builtin.forward([_datum()], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    weighted = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [-2.0 * x for x in lp]},
    )
    builtin.forward_backward([weighted], "cross_entropy").result()
    adam = types.AdamParams(learning_rate=1e-3)
    custom_norm = custom.optim_step(adam).result().metrics["grad_norm:mean"]
    builtin_norm = builtin.optim_step(adam).result().metrics["grad_norm:mean"]
    assert custom_norm > 0
    assert custom_norm == pytest.approx(builtin_norm, rel=1e-6)


def test_create_custom_loss_upload_is_refused_naming_forward_backward_custom(shared_daemon):
    body = {"session_id": "s", "custom_loss_seq_id": 0, "name": "f", "inputs": [], "graph": {"format": 1, "nodes": []}}
    with httpx.Client(base_url=shared_daemon.url, headers={"X-API-Key": API_KEY}, timeout=30) as client:
        response = client.post("/api/v1/create_custom_loss", json=body)
    assert response.status_code == 400
    detail = response.json()["detail"]
    assert detail.startswith("server-side custom losses are not supported by this server")
    assert "forward_backward_custom with custom_loss_server_side=false" in detail
