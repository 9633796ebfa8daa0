"""The official `openai` Python client against `kvrun serve`.

Usage: python3 tests/openai_client.py http://127.0.0.1:PORT/v1
Run by tests/server.rs (openai_python_client); prints "openai client: ok".
"""

import sys

import openai
from openai import OpenAI

base_url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080/v1"
client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)

models = client.models.list()
model = models.data[0].id
assert model, models

messages = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
]
args = dict(model=model, messages=messages, max_tokens=10, temperature=0, seed=1)

# non-streaming
r = client.chat.completions.create(**args)
text = r.choices[0].message.content
assert r.id.startswith("chatcmpl-"), r.id
assert r.object == "chat.completion"
assert text, r
assert r.choices[0].finish_reason in ("stop", "length"), r
assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 10, r.usage
assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

# streaming: the deltas add up to the same greedy text, usage comes last
parts, finish, usage = [], None, None
for chunk in client.chat.completions.create(
    **args, stream=True, stream_options={"include_usage": True}
):
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.content:
            parts.append(c.delta.content)
        if c.finish_reason:
            finish = c.finish_reason
streamed = "".join(parts)
assert streamed == text, (streamed, text)
assert finish == r.choices[0].finish_reason, finish
assert usage is not None and usage.completion_tokens == r.usage.completion_tokens, usage

# raw completions
c = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5, temperature=0)
assert c.choices[0].text, c

# log-probabilities: the client's typed objects read them
r = client.chat.completions.create(**args, logprobs=True, top_logprobs=2)
lp = r.choices[0].logprobs.content
assert len(lp) == r.usage.completion_tokens, lp
assert "".join(e.token for e in lp) == r.choices[0].message.content, lp
for e in lp:
    assert e.logprob <= 0 and bytes(e.bytes).decode("utf-8", "replace") == e.token, e
    assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob, e
c = client.completions.create(
    model=model, prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=2
)
clp = c.choices[0].logprobs
assert "".join(clp.tokens) == c.choices[0].text, clp
assert len(clp.token_logprobs) == len(clp.top_logprobs) == len(clp.text_offset) == len(clp.tokens)

# errors surface as the client's typed exceptions
try:
    client.chat.completions.create(model=model, messages=[], max_tokens=2)
    raise AssertionError("empty messages accepted")
except openai.BadRequestError as e:
    assert "messages" in str(e), e

print(f"openai client: ok ({text!r}, {len(parts)} streamed deltas)")
