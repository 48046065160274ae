"""R7.5: `--served-model-name NAME [NAME ...]` are the ids clients send and /v1/models lists
(one entry each); answers report the first. As vLLM's flag does, they replace the model's own
ids (the folder name, the path), so a TEI or infinity user switches by changing the URL only;
the deployment's name keeps working (the config's own routing key). R4.1/R6.2:
`--adaptive-threads` decides the workers' mode over the variable."""

from __future__ import annotations

import pytest

from tests.conftest import Server

SERVED = "BAAI/bge-small-en-v1.5"
ALIAS = "text-embedding-3-small"  # a second served name: accepted, listed, never reported


@pytest.fixture(scope="module")
def embedder_dir(tmp_path_factory):
    from tests.tiny_models import bert_embedder

    return bert_embedder(tmp_path_factory.mktemp("folder-name"))


@pytest.fixture(scope="module")
def served(embedder_dir):
    server = Server(str(embedder_dir), "--served-model-name", SERVED, ALIAS, "--threads", "1",
                    "--backend", "torch", "--adaptive-threads", "learn",
                    env={"VLLM_SRUN_CPU_ADAPTIVE_THREADS": "2"}).wait_ready()
    yield server
    # a learning in-process server takes longer than close()'s 15 s grace to exit on SIGTERM
    # (so does one started with the variable alone); it holds no child processes: kill it
    server.client.close()
    server.proc.kill()
    server.proc.communicate()


def _embed(server: Server, model: str | None):
    body = {"input": ["hello world"], **({"model": model} if model is not None else {})}
    return server.client.post("/v1/embeddings", json=body)


def test_models_lists_every_served_name(served):
    first, second = served.client.get("/v1/models").json()["data"]
    assert (first["id"], second["id"]) == (SERVED, ALIAS)
    assert {k: v for k, v in first.items() if k != "id"} == \
        {k: v for k, v in second.items() if k != "id"}  # one deployment, listed twice
    assert (first["deployment"], first["dimensions"]) == ("primary", 64)
    infinity = served.client.get("/models").json()["data"]
    assert [m["id"] for m in infinity] == [SERVED, ALIAS]
    assert served.client.get("/health").json()["model"] == SERVED
    assert served.client.get("/info").json()["served_model_name"] == SERVED


@pytest.mark.parametrize("model", [SERVED, ALIAS, "primary", None])
def test_requests_naming_any_served_name_or_the_deployment_are_served(served, model):
    """Answers report the first served name, whichever the request sent (as vLLM's do)."""
    r = _embed(served, model)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == SERVED and len(r.json()["data"][0]["embedding"]) == 64
    r = served.client.post("/embeddings", json={"input": ["hi"], "model": model or SERVED})
    assert r.status_code == 200 and r.json()["model"] == SERVED, r.text


def test_the_replaced_ids_are_unknown_models(served, embedder_dir):
    for old in (embedder_dir.name, str(embedder_dir)):
        r = _embed(served, old)
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert error["code"] == "model_not_found"
        assert SERVED in error["message"] and ALIAS in error["message"]


def test_openai_client_sends_the_served_name(served):
    from openai import OpenAI

    client = OpenAI(base_url=f"{served.url}/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == [SERVED, ALIAS]
    out = client.embeddings.create(model=ALIAS, input=["hello"])
    assert out.model == SERVED and len(out.data[0].embedding) == 64


def test_the_flag_sets_the_workers_mode_over_the_variable(served):
    """VLLM_SRUN_CPU_ADAPTIVE_THREADS=2 in the environment, --adaptive-threads learn on the
    command line: the worker learns in mode 1."""
    (report,) = served.client.get("/v1/threads").json()["reports"]
    assert report["mode"] == 1
