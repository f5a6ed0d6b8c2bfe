"""vLLM as the engine of Halfmoon's services (HALFMOON_ENGINE=vllm): the same greedy text as vLLM serving the
model alone, through the prefill-to-decode hand-off over the pool, through a decode instance's death, and
aggregated.

One Halfmoon cluster (1 prefill + 2 decode instances on vLLM) and one plain vLLM API server, the
reference, start together; both run SmolLM2 in float32, eager (torch.compile's warm-up is minutes of a
CPU start). The engines run vLLM's interpreter (``HALFMOON_VLLM_PYTHON``) on this checkout's source, and
the module skips without one, as tests/vllm/test_vllm_connector.py does.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from transformers import AutoTokenizer

from halfmoon.cli.model_tools import materialise_smollm2
from halfmoon.core.keys import BlockHasher, Namespace
from halfmoon.deploy.drills import operator_nats
from halfmoon.deploy.local import LocalCluster
from halfmoon.deploy.processes import free_port
from halfmoon.engine.loader import model_fingerprint
from halfmoon.protocol import codecs
from halfmoon.protocol.pool import SnapshotRequest
from halfmoon.protocol.stream import TokenEvent
from halfmoon.protocol.subjects import Subjects
from halfmoon.telemetry.jsonl import read_spans
from tests.conftest import service_env
from tests.e2e.conftest import AUTH, model_name, start_cluster
from tests.e2e.test_tracing import spans_of_request
from tests.faults.test_recovery import RECOVERY_ENV
from tests.vllm.test_vllm_connector import BLOCK, START_TIMEOUT_S, TENANT_SALT, VLLM_PYTHON, VllmServer

STREAMS = 8
MAX_TOKENS = 48
KILL_AT = 24  # tokens every stream on the victim has streamed when it is killed
PROMPTS = [" ".join(f"moon{i} phase{j}" for j in range(2 + 5 * i)) for i in range(STREAMS)]
EAGER = {"enforce_eager": True, "compilation_config": {"mode": 0}}
VLLM_CPU_BLOCK = 128  # tokens in one of vLLM's CPU KV blocks, its default there

pytestmark = [
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"no vLLM interpreter at {VLLM_PYTHON} "
                       "(set HALFMOON_VLLM_PYTHON to a venv's python with vllm-cpu installed)"),
    pytest.mark.timeout(1800),
]


def start_reference(model: Path, log: Path) -> VllmServer:
    """vLLM's own API server on the model, at its defaults but for the dtype and eager mode."""
    port = free_port()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
             "--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager", "--compilation-config",
             json.dumps(EAGER["compilation_config"])],
            env=service_env(VLLM_CPU_KVCACHE_SPACE="1"), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    return VllmServer(proc, port, log)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return materialise_smollm2(tmp_path_factory.mktemp("smollm2"))


@pytest.fixture(scope="module")
def started(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, VllmServer]]:
    """The cluster (whose start waits for its engines) and the reference server, started at once."""
    reference = start_reference(smollm2, tmp_path_factory.mktemp("vllm-reference") / "vllm.log")
    cluster = None
    try:
        # every stream admitted: the SLOs are not what these tests are about
        env = {**RECOVERY_ENV, "HALFMOON_TBT_SLO_S": "60", "HALFMOON_TTFT_SLO_S": "600", "HALFMOON_ENGINE": "vllm",
               "HALFMOON_VLLM_ARGS": json.dumps(EAGER), "HALFMOON_KV_CACHE_BYTES": str(1 << 29)}
        # the reference server's dtype: the texts are compared
        cluster = start_cluster(smollm2, tmp_path_factory.mktemp("run-vllm-engine"), env=env,
                                engine_python=str(VLLM_PYTHON), timeout=START_TIMEOUT_S, dtype="float32",
                                prefill=1, decode=2)
        reference.wait_ready(time.monotonic() + START_TIMEOUT_S)
        yield cluster, reference
    finally:
        if cluster is not None:
            cluster.stop()
        reference.stop()


@pytest.fixture(scope="module")
def reference_texts(started: tuple[LocalCluster, VllmServer], smollm2: Path) -> list[str]:
    _, reference = started

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=reference.url, timeout=300) as http:
            return list(await asyncio.gather(*(complete(http, str(smollm2), prompt) for prompt in PROMPTS)))

    return asyncio.run(run())


async def complete(http: httpx.AsyncClient, model: str, prompt: str) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    reply = await http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    return str(choice["text"])


async def stream(http: httpx.AsyncClient, model: str, prompt: str) -> tuple[str, int, str]:
    """The streamed text, how many chunks carried text, and the finish reason."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    text, finish, completion_tokens = "", "", 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                text += choice["text"]
                finish = choice["finish_reason"] or finish
            completion_tokens = (chunk.get("usage") or {}).get("completion_tokens", completion_tokens)
    return text, completion_tokens, finish


def cluster_texts(cluster: LocalCluster) -> list[str]:
    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=cluster.url, headers=AUTH, timeout=httpx.Timeout(300, connect=10)) as http:
            return list(await asyncio.gather(*(complete(http, model_name(cluster), p) for p in PROMPTS)))

    return asyncio.run(run())


def test_prefill_and_decode_on_vllm_give_vllm_alones_greedy_text(started, smollm2: Path,
                                                                  reference_texts: list[str]) -> None:
    """8 concurrent prompts: prefill's vLLM computes each prompt and stores its full blocks in the pool;
    the decode instance's vLLM loads them from there (its connector's pool hits) and generates the rest."""
    cluster, _ = started
    assert cluster_texts(cluster) == reference_texts
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    # a prompt with a full block before its last token (which decode computes itself) is a pool hit there
    with_blocks = sum(1 for prompt in PROMPTS if (len(tokenizer(prompt).input_ids) - 1) // BLOCK)
    decode_logs = "".join(cluster.log_file(f"decode-{i}").read_text() for i in range(2))
    hits = decode_logs.count("HalfmoonConnector: pool hit")
    # a lookup the cache-manager does not answer within its timeout (a loaded 2-core CI machine) is computed
    # instead, by design, and logged: the text above still held; any other miss fails here
    unanswered = decode_logs.count("pool lookup failed")
    lookups = [line for line in decode_logs.splitlines() if "HalfmoonConnector" in line or "pool lookup" in line]
    assert with_blocks >= STREAMS - 1 and hits + unanswered >= with_blocks and hits >= with_blocks // 2, lookups


def layer_spans(cluster: LocalCluster, trace_id: str, name: str, layers: int, parent_id: str | None = None
                ) -> list[dict]:
    """The trace's ``name`` spans (under ``parent_id`` if given), one per layer in layer order, once all are
    exported (the connector's spans leave vLLM's worker in their own batches, after the reply)."""
    deadline = time.monotonic() + 30
    while True:
        found = sorted((s for s in read_spans(cluster.trace_file) if s["trace_id"] == trace_id and s["name"] == name
                        and parent_id in (None, s["parent_id"])), key=lambda s: s["attributes"]["halfmoon.layer"])
        if len(found) >= layers or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def traced_completion(cluster: LocalCluster, prompt: str, span: str) -> list[dict]:
    """The spans of a short greedy completion of ``prompt``, once its trace holds a ``span``."""
    reply = httpx.post(f"{cluster.url}/v1/completions", headers=AUTH, timeout=300,
                       json={"model": model_name(cluster), "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return spans_of_request(cluster, reply.headers["x-request-id"], names=frozenset({span}))


def test_decode_reads_the_prompts_layers_from_the_pool_while_earlier_layers_compute(started, smollm2: Path) -> None:
    """The hand-off's load, seen in the request's trace: decode's connector reads the prompt's blocks from
    the pool one layer at a time (a ``pool.layer_read`` span each, in order), vLLM computes each layer once
    its KV is in (``vllm.layer_forward``), and reading goes on while the layers before compute."""
    cluster, _ = started
    layers = json.loads((smollm2 / "config.json").read_text())["num_hidden_layers"]
    spans = traced_completion(cluster, " ".join(f"layer{i}" for i in range(400)), "vllm.kv_load")
    (load,) = [s for s in spans if s["name"] == "vllm.kv_load"]
    assert load["service"] == "decode" and load["attributes"]["halfmoon.blocks"] >= 40
    reads = layer_spans(cluster, load["trace_id"], "pool.layer_read", layers)
    forwards = layer_spans(cluster, load["trace_id"], "vllm.layer_forward", layers)
    assert [s["attributes"]["halfmoon.layer"] for s in reads] == list(range(layers))
    assert all(s["parent_id"] == load["span_id"] for s in reads)
    assert [s["attributes"]["halfmoon.layer"] for s in forwards] == list(range(layers))
    for layer in range(layers):  # a layer computes on its own KV, in, verified and copied
        assert reads[layer]["end_ns"] <= forwards[layer]["start_ns"]
    for layer in range(layers - 1):  # and the next layer's read is under way before it is done
        assert reads[layer + 1]["start_ns"] < forwards[layer]["end_ns"]
    # so the first layers computed while the last ones were still being read
    assert forwards[0]["start_ns"] < reads[-1]["end_ns"]


def test_prefill_writes_each_layer_into_the_pool_while_the_later_layers_compute(started, smollm2: Path) -> None:
    """The hand-off's store, seen in the request's trace: prefill's connector places the prompt's blocks as
    the step begins and writes each layer into the pool once vLLM's attention has it in the cache (a
    ``vllm.kv_layer_store`` span each, from the moment the layer's KV was in, under ``vllm.kv_store``), so the
    first layers are in the pool before the last one is computed and the step's end waits for the commit."""
    cluster, _ = started
    layers = json.loads((smollm2 / "config.json").read_text())["num_hidden_layers"]
    prompt = " ".join(f"store{i}" for i in range(300))
    spans = traced_completion(cluster, prompt, "vllm.kv_store")
    stores = [s for s in spans if s["name"] == "vllm.kv_store" and s["service"] == "prefill"]
    assert stores, "prefill stored none of the prompt's blocks"
    blocks = 0
    for store in stores:  # one a prefill step (vLLM may chunk the prompt)
        writes = layer_spans(cluster, store["trace_id"], "vllm.kv_layer_store", layers, store["span_id"])
        assert [s["attributes"]["halfmoon.layer"] for s in writes] == list(range(layers))
        for earlier, later in itertools.pairwise(writes):  # layer by layer, each after its KV was in
            assert earlier["start_ns"] <= later["start_ns"] and earlier["end_ns"] <= later["end_ns"]
        # the first layer was in the pool before the last layer's KV was computed
        assert writes[0]["end_ns"] < writes[-1]["start_ns"]
        assert writes[-1]["end_ns"] <= store["end_ns"]
        blocks += writes[0]["attributes"]["halfmoon.blocks"]
    tokens = len(AutoTokenizer.from_pretrained(smollm2)(prompt).input_ids)
    assert blocks == (tokens - 1) // BLOCK or blocks == tokens // BLOCK


def test_prefill_reports_vllms_prefix_cache_to_the_conductor_as_block_keys(started, smollm2: Path) -> None:
    """vLLM's own prefix cache, as the conductor indexes Halfmoon's engine's: once a prompt is served, the
    prefill instance's KVEvents carry the pool keys of every full vLLM block of it vLLM now caches (its
    tenant's keys, as the gateway asks for them), and none of the tokens after them; a snapshot that
    the conductor asks for holds them too."""
    cluster, _ = started
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompt = " ".join(f"cached{i}" for i in range(200))
    tokens = tokenizer(prompt).input_ids
    hasher = BlockHasher(BLOCK, Namespace(model_fingerprint(smollm2, torch.float32).hex(), TENANT_SALT))
    keys = hasher.keys(tokens)
    cached = len(tokens) // VLLM_CPU_BLOCK * (VLLM_CPU_BLOCK // BLOCK)  # vLLM caches whole blocks of its own
    assert cached >= 2 * (VLLM_CPU_BLOCK // BLOCK), len(tokens)
    subjects = Subjects(cluster.namespace)

    async def run() -> tuple[set[bytes], set[bytes]]:
        nc = await operator_nats(cluster)
        reported: set[bytes] = set()
        snapshot: set[bytes] = set()

        async def on_events(msg) -> None:  # type: ignore[no-untyped-def]
            events = codecs.KV_EVENTS.decode(msg.data)
            if events.instance_id.startswith("prefill"):
                (snapshot if events.snapshot else reported).update(events.stored)

        await nc.subscribe(subjects.kv_events, cb=on_events)
        await nc.flush()
        async with httpx.AsyncClient(base_url=cluster.url, headers=AUTH, timeout=300) as http:
            reply = await http.post("/v1/completions", json={"model": model_name(cluster), "prompt": prompt,
                                                             "max_tokens": 2, "temperature": 0})
            assert reply.status_code == 200, reply.text
        deadline = time.monotonic() + 30
        while not set(keys[:cached]) <= reported and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await nc.publish(subjects.kv_snapshot, codecs.KV_SNAPSHOT_REQUEST.encode(SnapshotRequest()))
        while not set(keys[:cached]) <= snapshot and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await nc.close()
        return reported, snapshot

    reported, snapshot = asyncio.run(run())
    assert set(keys[:cached]) <= reported, f"{len(set(keys[:cached]) & reported)} of {cached} keys reported"
    assert not set(keys[cached:]) & reported  # the partial vLLM block is not vLLM's cache
    assert set(keys[:cached]) <= snapshot


def test_a_killed_vllm_decode_instance_loses_no_stream_and_duplicates_no_token(started,
                                                                               reference_texts: list[str]) -> None:
    """SIGKILL decode-0 once every stream it serves is past ``KILL_AT``: its streams migrate (the prompt and
    the tokens so far go to prefill again, whose vLLM finds the prompt's blocks in the pool) and end on the
    other decode instance, with vLLM alone's text and no token twice; vLLM's engine processes die with it."""
    cluster, _ = started
    victim = "decode-0"
    engine_processes = psutil.Process(cluster.procs[victim].pid).children(recursive=True)  # vLLM's engine core, worker
    assert len(engine_processes) >= 2, engine_processes

    async def run() -> tuple[list[tuple[str, int, str]], dict[str, int], set[str]]:
        nc = await operator_nats(cluster)
        served: dict[str, int] = {}  # request -> the victim's highest token index for it
        attempts: dict[str, int] = {}
        killed = asyncio.Event()

        async def on_event(msg) -> None:  # type: ignore[no-untyped-def]
            event = codecs.STREAM.decode(msg.data)
            if not isinstance(event, TokenEvent):
                return
            attempts[event.request_id] = max(attempts.get(event.request_id, 0), event.attempt)
            if event.instance_id == victim and not killed.is_set():
                served[event.request_id] = max(served.get(event.request_id, 0), event.index)
                if len(attempts) == STREAMS and served and min(served.values()) >= KILL_AT:
                    cluster.kill(victim)
                    killed.set()

        await nc.subscribe(Subjects(cluster.namespace).stream_any, cb=on_event)
        await nc.flush()
        async with httpx.AsyncClient(base_url=cluster.url, headers=AUTH,
                                     timeout=httpx.Timeout(300, connect=10)) as http:
            done = await asyncio.gather(*(stream(http, model_name(cluster), prompt) for prompt in PROMPTS))
        await nc.close()
        assert killed.is_set(), "the streams ended before the decode instance could be killed"
        return list(done), attempts, set(served)

    done, attempts, on_victim = asyncio.run(run())
    assert on_victim, "no stream was on the killed instance"
    assert all(attempts[rid] == 1 for rid in on_victim), attempts  # each of its streams migrated, once
    assert [text for text, _, _ in done] == reference_texts
    assert all(tokens == MAX_TOKENS and finish == "length" for _, tokens, finish in done), done
    _, alive = psutil.wait_procs(engine_processes, timeout=60)
    assert not alive, f"vLLM's processes outlived their killed service: {alive}"


def test_an_aggregated_vllm_instance_gives_vllm_alones_greedy_text(started, reference_texts: list[str]) -> None:
    """Then the deployment becomes one aggregated vLLM instance: an added one, the others drained."""
    cluster, _ = started
    aggregated = cluster.add_instance("aggregated")
    deadline = time.monotonic() + START_TIMEOUT_S
    while cluster.read_ready(aggregated) is None:
        assert cluster.procs[aggregated].poll() is None, cluster.log_file(aggregated).read_text()[-4000:]
        assert time.monotonic() < deadline, f"{aggregated} did not start"
        time.sleep(1.0)
    for instance in ("prefill-0", "decode-1"):
        cluster.retire_instance(instance)
        cluster.procs[instance].wait(60)
    assert cluster_texts(cluster) == reference_texts
    deadline = time.monotonic() + 30
    while "aggregated.generate" not in cluster.trace_file.read_text():  # exported after the replies
        assert time.monotonic() < deadline, "no aggregated.generate span"
        time.sleep(0.2)


def test_sampling_and_engine_arguments_map_halfmoons_settings_onto_vllms() -> None:
    """What VllmEngine hands vLLM, checked in vLLM's interpreter: the rest of a continued request's tokens,
    one token for a prefill, the block keys for the connector, KV cache events on the instance's own endpoint,
    and vLLM arguments Halfmoon sets refused."""
    script = """
import json
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.vllm_engine import KEYS_PARAM, engine_args, vllm_sampling
from halfmoon.protocol.sampling import SamplingParams
params = SamplingParams(max_tokens=10, temperature=0.0, top_k=0, stop=("x",), logprobs=True)
rest = vllm_sampling(params, 4, False, [b"\\x01" * 16])
first = vllm_sampling(params, 0, True, [])
config = EngineConfig(model="/m", dtype="float32", max_num_seqs=7)
args = engine_args(config, "decode", {"nats_url": "nats://n:1"}, "ipc:///run/e", {"enforce_eager": True})
refused = []
for extra in ({"max_num_seqs": 3}, {"no_such_argument": 1}, {"kv_events_config": None}):
    try:
        engine_args(config, "decode", {}, "ipc:///run/e", extra)
    except ValueError as exc:
        refused.append(str(exc))
try:
    vllm_sampling(params, 10, False, [])
except ValueError as exc:
    refused.append(str(exc))
print(json.dumps({"rest": rest.max_tokens, "top_k": rest.top_k, "logprobs": rest.logprobs, "stop": rest.stop,
                  "keys": rest.extra_args["kv_transfer_params"][KEYS_PARAM], "first": first.max_tokens,
                  "eager": args.enforce_eager, "seqs": args.max_num_seqs, "dtype": args.dtype,
                  "pool": args.kv_transfer_config.kv_connector_extra_config, "refused": refused,
                  "events": [args.kv_events_config.enable_kv_cache_events, args.kv_events_config.endpoint]}))
"""
    done = subprocess.run([str(VLLM_PYTHON), "-c", script], env=service_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["rest"] == 6 and got["first"] == 1 and got["top_k"] == 0 and got["logprobs"] == 0
    assert got["stop"] == ["x"] and got["keys"] == ["01" * 16]
    assert got["eager"] is True and got["seqs"] == 7 and got["dtype"] == "float32"
    assert got["pool"] == {"block_size": 16, "nats_role": "decode", "exit_with_parent": True, "nats_url": "nats://n:1"}
    assert "['max_num_seqs']" in got["refused"][0] and "HALFMOON_MAX_NUM_SEQS" in got["refused"][0]
    assert "no_such_argument" in got["refused"][1] and "kv_events_config" in got["refused"][2]
    assert "leaves nothing" in got["refused"][3]
    assert got["events"] == [True, "ipc:///run/e"]
