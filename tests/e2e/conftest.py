"""A real deployment per module: NATS, every service as its own process, the tiny model."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from halfmoon.deploy.local import LocalCluster

API_KEY = "sk-e2e-0123456789abcdef"
# The engines' dtype: HALFMOON_DTYPE where the run sets it (CI is run in float32 and in bfloat16, standing in
# for machines whose default is either), else float32.
CLUSTER_DTYPE = os.environ.get("HALFMOON_DTYPE", "float32")
# What clusters whose text is compared with ``reference_text`` run in: transformers' greedy output in float32.
# bfloat16 in another kernel order is not expected to pick the same tokens.
REFERENCE_DTYPE = "float32"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def start_cluster(model: Path, run_dir: Path, env: dict[str, str] | None = None, api_keys: str = f"{API_KEY} e2e\n",
                  engine_python: str | None = None, timeout: float = 240, dtype: str = CLUSTER_DTYPE,
                  **counts: int) -> LocalCluster:
    """Security on, as ``halfmoon up`` with keys: per-role NATS credentials, and API keys (send ``AUTH``)."""
    keys = run_dir / "api-keys"
    keys.write_text(api_keys)
    # Heartbeats every 0.25 s, so the conductor notices a killed instance within about a second.
    env = {"HALFMOON_DTYPE": dtype, "HALFMOON_HEARTBEAT_INTERVAL_S": "0.25", "HALFMOON_INSTANCE_TIMEOUT_S": "1.5",
           "HALFMOON_ITL_TIMEOUT_S": "20", "OTEL_BSP_SCHEDULE_DELAY": "100", "HALFMOON_API_KEYS_FILE": str(keys),
           **(env or {})}
    cluster = LocalCluster(model, run_dir, counts, gateway_port=0, namespace="e2e", env=env,
                           engine_python=engine_python)
    cluster.start(timeout=timeout)
    return cluster


@pytest.fixture(scope="module")
def cluster_2p2d(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = start_cluster(tiny_model_dir, tmp_path_factory.mktemp("run-2p2d"), dtype=REFERENCE_DTYPE,
                            prefill=2, decode=2)
    yield cluster
    cluster.stop()


def model_name(cluster: LocalCluster) -> str:
    return httpx.get(f"{cluster.url}/v1/models", headers=AUTH, timeout=10).json()["data"][0]["id"]


async def admin_nats(cluster: LocalCluster):  # type: ignore[no-untyped-def]
    """A NATS connection with the operator's credentials (taps see every subject)."""
    assert cluster.nats_auth is not None
    return await nats.connect(cluster.nats_url, **cluster.nats_auth.connect_options())


def reference_text(model_dir: Path, prompt_ids: list[int], max_tokens: int) -> str:
    """What transformers generate (greedy) continues ``prompt_ids`` with, as text."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = _hf_model(str(model_dir))
    ids = torch.tensor([prompt_ids])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
    return tokenizer.decode(out[0, len(prompt_ids):], skip_special_tokens=True)


@functools.cache
def _hf_model(model_dir: str):  # type: ignore[no-untyped-def]
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()
