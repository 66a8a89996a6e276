"""Tiny vLLM engines on CPU, and routers in front of them, as processes.

Used by `check_vllm.py` (the real-engine test) and
`benches/router/real_engines.py` (the measurements). An engine is vLLM 0.32
for CPU (see `install-vllm.sh`) serving a 2-layer Llama with dummy weights
and a word-level tokenizer whose word `tN` is token id N, so text prompts
and token-id prompts reach the engine as the same ids. Prefix caching is on,
with the `sha256_cbor` block hash, KV cache events over ZMQ, and each
response's `usage.prompt_tokens_details.cached_tokens`.
"""

import json
import os
import random
import signal
import socket
import subprocess
import time
import urllib.request

BLOCK = 32  # tokens per KV block (the CPU attention backend refuses 16)
MODEL = "tiny"
VOCAB = 32000

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": VOCAB,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


_GIVEN = set()  # the ports free_ports handed out in this process


def free_ports(n):
    """`n` distinct loopback ports free now, for servers started next, none
    handed out before by this process.

    They come from below the kernel's ephemeral range: a port taken from
    inside it (by binding port 0) can be handed to some process's outgoing
    connection between this check and the server's own bind."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    low, high = 10000, max(ephemeral_low, 20000)
    rng = random.Random()
    ports = []
    for _ in range(10000):
        if len(ports) == n:
            break
        port = rng.randrange(low, high)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        _GIVEN.add(port)
    if len(ports) < n:
        raise RuntimeError(f"fewer than {n} free loopback ports in {low}..{high} after 10,000 tries")
    return ports


def write_model(directory):
    """The model directory: config.json and a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    # Id 0 (never in a prompt) is a long word: vLLM refuses a text prompt
    # longer than max-model-len x its longest vocabulary entry, and text
    # prompts here take up to 7 characters a token ("t31999 ").
    vocab = {"unknown-word": 0, **{f"t{i}": i for i in range(1, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="unknown-word"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(
            # No special tokens: transformers matches them inside words
            # (a bos "t1" would split "t123").
            {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 2048},
            f,
        )
    return directory


def text_of(tokens):
    return " ".join(f"t{t}" for t in tokens)


class Engine:
    """One vLLM process. Its PUB socket connects to `events_port` (the
    router binds there), or binds it with `bind_events` (routers connect to
    `events_connect`); its replay ROUTER binds `replay_port`."""

    def __init__(self, venv, model_dir, log_dir, blocks, name, bind_events=False):
        self.venv, self.model_dir, self.blocks, self.name = venv, model_dir, blocks, name
        self.bind_events = bind_events
        self.port, self.events_port, self.replay_port = free_ports(3)
        self.log_path = os.path.join(log_dir, f"vllm-{name}.log")
        self.proc = None

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self):
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def events_connect(self):
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self):
        return f"tcp://127.0.0.1:{self.replay_port}"

    def start(self):
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_port}" if self.bind_events else self.events_endpoint,
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": "kv",
        }
        cmd = [
            f"{self.venv}/bin/vllm", "serve", self.model_dir,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--served-model-name", MODEL, "--load-format", "dummy", "--dtype", "bfloat16",
            "--enable-prefix-caching", "--prefix-caching-hash-algo", "sha256_cbor",
            "--block-size", str(BLOCK), "--max-model-len", "2048",
            "--num-gpu-blocks-override", str(self.blocks), "--enforce-eager",
            "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(events),
        ]  # fmt: skip
        env = dict(os.environ)
        env.update(
            HF_HUB_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            VLLM_SERVER_DEV_MODE="1",  # /reset_prefix_cache
        )
        env.pop("PYTHONHASHSEED", None)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def healthy(self):
        try:
            return urllib.request.urlopen(self.url + "/health", timeout=2).status == 200
        except OSError:
            return False

    def wait_healthy(self, deadline):
        while not self.healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine {self.name} exited {self.proc.returncode}:\n{self.tail()}")
            if time.time() > deadline:
                raise RuntimeError(f"engine {self.name} not healthy in time:\n{self.tail()}")
            time.sleep(1)

    def tail(self, n=40):
        with open(self.log_path, "rb") as f:
            return b"\n".join(f.read().splitlines()[-n:]).decode(errors="replace")

    def kill(self):
        """SIGKILL to the engine's whole process group (its engine core too)."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self):
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def reset_prefix_cache(self):
        req = urllib.request.Request(self.url + "/reset_prefix_cache", data=b"", method="POST")
        urllib.request.urlopen(req, timeout=30).read()

    def prefix_cache_counters(self):
        """(queries, hits) in tokens, from the engine's /metrics."""
        text = urllib.request.urlopen(self.url + "/metrics", timeout=5).read().decode()
        out = {}
        for line in text.splitlines():
            for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
                if line.startswith(name):
                    out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out.get("vllm:prefix_cache_queries_total", 0.0), out.get("vllm:prefix_cache_hits_total", 0.0)


def start_engines(venv, model_dir, log_dir, blocks, n=2, timeout=600, bind_events=False):
    engines = [Engine(venv, model_dir, log_dir, blocks, chr(ord("a") + i), bind_events) for i in range(n)]
    for e in engines:
        e.start()
    deadline = time.time() + timeout
    try:
        for e in engines:
            e.wait_healthy(deadline)
    except BaseException:
        for e in engines:
            e.stop()
        raise
    return engines


class Process:
    """A router process (selkie, vllm-router, smg) on `port`."""

    def __init__(self, cmd, port, log_path, env=None):
        self.port, self.log_path = port, log_path
        log = open(log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout=60, path="/v1/models"):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited {self.proc.returncode}:\n{self.tail()}")
            try:
                body = json.load(urllib.request.urlopen(self.url + path, timeout=2))
                if body.get("data"):
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"router not ready in {timeout}s:\n{self.tail()}")

    def tail(self, n=40):
        with open(self.log_path, "rb") as f:
            return b"\n".join(f.read().splitlines()[-n:]).decode(errors="replace")

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def selkie(binary, engines, log_path, policy="kv", kv_hash="tokens", events=True, extra=()):
    port = free_ports(1)[0]
    cmd = [binary, "serve", "--port", str(port), "--policy", policy, "--block-size", str(BLOCK)]
    for e in engines:
        cmd += ["--worker", e.url]
        if events:
            cmd += ["--kv-events", f"{e.url}={e.events_endpoint},mode=bind,replay={e.replay_endpoint},topic=kv"]
    if events:
        cmd += ["--kv-hash", kv_hash]
    cmd += list(extra)
    return Process(cmd, port, log_path, env=dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "info")))


def metrics(url):
    """Prometheus text as {'name{labels}': value}."""
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def complete(url, prompt, max_tokens=4, stream=False, timeout=120, headers=None):
    """POST /v1/completions; returns (response headers, body as JSON or the
    list of SSE events)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        if not stream:
            return r.headers, json.load(r)
        events = []
        for line in r:
            line = line.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                events.append(json.loads(line[6:]))
        return r.headers, events


def cached_tokens(usage):
    details = usage.get("prompt_tokens_details") or {}
    return details.get("cached_tokens") or 0
