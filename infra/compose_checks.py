"""The compose check's steps against a running stack: serve, metrics, trace, heal, nats-loss."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.parse

from compose_engine import DOCKER, Failed, log, poll, run
from compose_stack import Stack, http_json, stream_text

SCRAPED = {"gateway": 2, "conductor": 1, "cache-manager": 1, "transfer": 1, "prefill": 2, "decode": 2}
TRACE_SERVICES = ("gateway", "conductor", "prefill", "decode")

REFERENCE = r"""
import json, os, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
d = os.environ.get("HALFMOON_MODEL_DIR", "/models/tiny-llama")
tok = AutoTokenizer.from_pretrained(d)
hf = AutoModelForCausalLM.from_pretrained(d).eval()
texts = ["the cache block", "prefill and decode run apart", "a global conductor routes each request"]
prompts = [tok(t, add_special_tokens=False).input_ids for t in texts]
out = []
for p in prompts:
    ids = torch.tensor([p])
    g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX, do_sample=False)
    out.append(tok.decode(g[0, len(p):], skip_special_tokens=True))
long = tok(" ".join(texts * 12), add_special_tokens=False).input_ids[:160]
print(json.dumps({"prompts": prompts, "texts": out, "long": long}))
"""


# ---------------------------------------------------------------------------------------------- checks

MAX_TOKENS = 16


class Reference(threading.Thread):
    """transformers `generate` on the image's baked model (the one the `models` volume is filled
    from), in a one-off container started while the stack comes up."""

    def __init__(self, image: str, project: str) -> None:
        super().__init__(daemon=True)
        self.image, self.result, self.error = image, None, None
        self.name = f"{project}-reference"
        subprocess.run([DOCKER, "rm", "-f", self.name], capture_output=True)  # one a killed run left

    def run(self) -> None:
        try:
            out = run([DOCKER, "run", "--rm", "--name", self.name, "--label", f"com.docker.compose.project={self.name[:-10]}",
                       "--network", "none", "--entrypoint", "python", self.image, "-c",
                       REFERENCE.replace("MAX", str(MAX_TOKENS))], capture=True, quiet=True, timeout=1800).stdout
            self.result = json.loads(out.strip().splitlines()[-1])
        except Exception as exc:  # reported by the serve step
            self.error = exc

    def get(self) -> dict:
        self.join(timeout=1800)
        if self.result is None:
            raise Failed(f"the transformers reference failed: {self.error}")
        return self.result


def check_serve(stack: Stack, facts: dict) -> str:
    max_tokens = MAX_TOKENS
    ref = facts["reference"].get()
    model = http_json("GET", f"{stack.api}/v1/models")[0]["data"][0]["id"]
    facts["model"] = model
    url = f"{stack.api}/v1/completions"
    for prompt, expected in zip(ref["prompts"], ref["texts"]):
        for _ in range(2):  # nginx round-robins: each prompt reaches both gateways
            reply, headers = http_json("POST", url, {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0})
            got = reply["choices"][0]["text"]
            if got != expected:
                raise Failed(f"greedy completion differs from transformers generate: {got!r} != {expected!r}")
            facts["request_id"] = headers.get("x-request-id") or headers.get("X-Request-Id")
    text, chunks = stream_text(url, {"model": model, "prompt": ref["prompts"][0], "max_tokens": max_tokens,
                                     "temperature": 0})
    if text != ref["texts"][0] or chunks < 2:
        raise Failed(f"stream gave {chunks} chunks, {text!r} != {ref['texts'][0]!r}")
    cached = {"n": 0}

    def reused() -> bool:
        reply, _ = http_json("POST", url, {"model": model, "prompt": ref["long"], "max_tokens": 4, "temperature": 0})
        cached["n"] = ((reply.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return cached["n"] > 0

    poll("cached_tokens > 0 on a repeated prefix", reused, 120, interval=1)
    facts["ref"] = ref
    return f"{len(ref['prompts'])} greedy completions x2 == generate, stream {chunks} chunks, cached_tokens={cached['n']}"


def check_metrics(stack: Stack) -> str:
    def all_up() -> str:
        targets = http_json("GET", f"{stack.prometheus}/api/v1/targets?state=active")[0]["data"]["activeTargets"]
        seen: dict[str, list[str]] = {}
        for t in targets:
            seen.setdefault(t["labels"]["job"], []).append(t["health"])
        ok = all(seen.get(job, []).count("up") == n and len(seen.get(job, [])) == n for job, n in SCRAPED.items())
        return f"{sum(SCRAPED.values())} targets up ({', '.join(f'{j} {n}' for j, n in SCRAPED.items())})" if ok else ""

    up = poll("Prometheus to list every replica as up", all_up, 180, interval=2)
    return f"{up}; {check_kernels(stack)}"


def check_kernels(stack: Stack) -> str:
    """Every engine replica runs the C kernels the image prebuilt, not PyTorch's fallback."""
    engines = SCRAPED["prefill"] + SCRAPED["decode"]

    def reported() -> list[dict]:
        query = urllib.parse.quote('halfmoon_engine_kernels == 1')
        found = http_json("GET", f"{stack.prometheus}/api/v1/query?query={query}")[0]["data"]["result"]
        return found if len(found) == engines else []

    kinds = [(r["metric"].get("job"), r["metric"].get("kind"), r["metric"].get("isa"), r["metric"].get("reason"))
             for r in poll("every engine's kernels report in Prometheus", reported, 120, interval=2)]
    if any(kind != "native" for _, kind, _, _ in kinds):
        raise Failed(f"an engine runs without the prebuilt kernels: {kinds}")
    return f"kernels native on {engines} engines ({', '.join(sorted({isa for _, _, isa, _ in kinds}))})"


def check_trace(stack: Stack, facts: dict) -> str:
    rid = facts.get("request_id")
    if not rid:
        raise Failed("no x-request-id header on the responses")
    source = ["--trace-file", "/traces/spans.jsonl"] if stack.offline else ["--jaeger", "http://jaeger:16686"]

    def spans() -> str:
        out = run(stack.cmd("exec", "-T", "gateway", "halfmoon", "trace", rid, *source, "--width", "200"),
                  env=stack.env, capture=True, check=False, quiet=True, timeout=120).stdout
        return out if all(s in out for s in TRACE_SERVICES) else ""

    out = poll(f"the spans of request {rid} from {', '.join(TRACE_SERVICES)}", spans, 120, interval=2)
    (stack.logs / "trace.txt").write_text(out)
    return f"request {rid}: spans from {', '.join(TRACE_SERVICES)} via `halfmoon trace {' '.join(source)}`"


class Load:
    """Requests one after another in a thread; counts what succeeded and what failed."""

    def __init__(self, stack: Stack, facts: dict) -> None:
        self.url = f"{stack.api}/v1/completions"
        self.body = {"model": facts["model"], "prompt": facts["ref"]["prompts"][1], "max_tokens": 8, "temperature": 0}
        self.ok = self.failed = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                http_json("POST", self.url, self.body, timeout=120, retry_for=30)
                self.ok += 1
            except Exception as exc:
                self.failed += 1
                self.errors.append(str(exc)[:200])
                self._stop.wait(0.5)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=180)

    def successes_after(self, count: int, n: int) -> bool:
        return self.ok >= count + n


def check_heal(stack: Stack, facts: dict) -> str:
    victim = stack.by_service()["decode"][0]
    name, restarts = victim["Name"].lstrip("/"), victim["RestartCount"]
    pid = victim["State"]["Pid"]
    with Load(stack, facts) as load:
        poll("requests flowing before the crash", lambda: load.ok >= 2, 120)
        before_ok, before_failed = load.ok, load.failed
        log(f"kill -KILL {pid} (the main process of {name}, from the host)")
        os.kill(pid, signal.SIGKILL)

        def restarted() -> bool:
            c = json.loads(run([DOCKER, "inspect", victim["Id"]], capture=True, quiet=True).stdout)[0]
            return c["RestartCount"] > restarts and c["State"]["Running"]

        poll(f"{name} restarted by its restart policy", restarted, 120)
        stack.wait_ready(600)
        healed_at = load.ok
        poll("5 requests served after the restart", lambda: load.successes_after(healed_at, 5), 300)
        during_ok, failed = load.ok - before_ok, load.failed - before_failed
    check_metrics(stack)
    errors = f" (e.g. {load.errors[-1]})" if failed else ""
    return f"{name} SIGKILLed, restarted and healthy; {during_ok} requests served meanwhile, {failed} failed{errors}"


def check_nats_loss(stack: Stack, facts: dict) -> str:
    timeout = float(os.environ.get("HALFMOON_CHECK_NATS_LOSS_S", "180"))
    services = stack.by_service()
    watched = {c["Id"]: (c["Name"].lstrip("/"), c["RestartCount"], c["State"]["StartedAt"])
               for n in ("conductor", "cache-manager", "transfer", "prefill", "decode", "gateway") for c in services[n]}
    stack.run("stop", "nats", capture=True)
    t0 = time.monotonic()
    try:
        def exited() -> set[str]:
            gone = _exited_names(watched)
            return gone if len(gone) == len(watched) else set()

        try:
            poll("every Halfmoon service to exit after losing NATS for good", exited, timeout, interval=2)
        except Failed:
            gone = _exited_names(watched)
            still = sorted(name for name, _, _ in watched.values() if name not in gone)
            raise Failed(f"still running {timeout:.0f} s after NATS went away: {', '.join(still)} "
                         f"(exited: {', '.join(sorted(gone)) or 'none'})") from None
        t_exit = time.monotonic() - t0
    finally:
        stack.run("start", "nats", capture=True)
    stack.wait_ready(900)
    http_json("POST", f"{stack.api}/v1/completions",
              {"model": facts["model"], "prompt": facts["ref"]["prompts"][0], "max_tokens": 4, "temperature": 0})
    return f"{len(watched)} containers exited within {t_exit:.0f} s of NATS stopping, restarted, healthy and serving"


def _exited_names(watched: dict) -> set[str]:
    gone = set()
    for cid, (name, restarts, started) in watched.items():
        c = json.loads(run([DOCKER, "inspect", cid], capture=True, quiet=True).stdout)[0]
        if c["RestartCount"] > restarts or c["State"]["StartedAt"] != started or not c["State"]["Running"]:
            gone.add(name)
    return gone
