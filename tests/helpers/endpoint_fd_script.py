"""Run as a script by ``test_agent_connection_cap.py``: an agent endpoint in a process whose open-files limit is
``argv[1]`` (soft and hard); prints its port, waits for a line on stdin (the test's idle connections are open), then
makes one episode call from this process (as an agent does) and prints its status or error."""

import resource
import sys

limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

import httpx  # noqa: E402
from conftest import TINY_LLAMA  # noqa: E402

from aitraining_pl.agents import AgentEndpoint  # noqa: E402
from aitraining_pl.models import build_causal_lm, load_tokenizer  # noqa: E402
from aitraining_pl.rollout import GenerationConfig, RolloutEngine  # noqa: E402

tokenizer = load_tokenizer("byte")
model = build_causal_lm(dict(TINY_LLAMA), seed=0).eval()
with AgentEndpoint(RolloutEngine(tokenizer, GenerationConfig(max_new_tokens=2)), model) as endpoint:
    key = endpoint.open_episode()
    print(endpoint.port, flush=True)
    sys.stdin.readline()
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
    try:
        answer = httpx.post(endpoint.base_url + "/chat/completions", json=body, timeout=8,
                            headers={"Authorization": f"Bearer {key}"})  # fmt: skip
        print(answer.status_code, flush=True)
    except Exception as err:  # noqa: BLE001 - what the test reads
        print(f"{type(err).__name__}: {err}", flush=True)
