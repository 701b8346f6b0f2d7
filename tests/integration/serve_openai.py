"""Drives `k3 serve` with the official openai client (argv[1] = base URL ending in /v1).

Checks chat (plain and streamed, the deltas adding up to the plain reply), thinking off
through extra_body, raw completions, the model list, prefix reuse on a follow-up, and a bad
request raised as BadRequestError. Prints a transcript, then "all checks passed".
"""

import sys

import openai

client = openai.OpenAI(base_url=sys.argv[1], api_key="unused")

models = [m.id for m in client.models.list()]
assert models == ["kimi-k3-local"], models

question = [{"role": "user", "content": "What is the capital of France?"}]
full = client.chat.completions.create(
    model="kimi-k3-local", messages=question, temperature=0, max_tokens=200
)
msg = full.choices[0].message
reasoning = getattr(msg, "reasoning_content", None) or (msg.model_extra or {}).get(
    "reasoning_content"
)
print("user: What is the capital of France?")
print("assistant (reasoning):", reasoning)
print("assistant:", msg.content)
assert "Paris" in msg.content, msg.content
assert reasoning, "thinking is on by default"
assert full.choices[0].finish_reason == "stop"

stream = client.chat.completions.create(
    model="kimi-k3-local",
    messages=question,
    temperature=0,
    max_tokens=200,
    stream=True,
    stream_options={"include_usage": True},
)
content, thought, usage = "", "", None
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    if not chunk.choices:
        continue
    delta = chunk.choices[0].delta
    content += delta.content or ""
    thought += (delta.model_extra or {}).get("reasoning_content") or ""
assert content == msg.content, (content, msg.content)
assert thought == reasoning, (thought, reasoning)
assert usage is not None and usage.completion_tokens == full.usage.completion_tokens

follow = question + [
    {"role": "assistant", "content": msg.content, "reasoning_content": reasoning},
    {"role": "user", "content": "And the capital of Spain?"},
]
second = client.chat.completions.create(
    model="kimi-k3-local",
    messages=follow,
    temperature=0,
    max_tokens=200,
    extra_body={"thinking": {"type": "disabled"}},
)
print("user: And the capital of Spain?  (thinking off)")
print("assistant:", second.choices[0].message.content)
cached = second.usage.prompt_tokens_details.cached_tokens
print("cached prompt tokens:", cached, "of", second.usage.prompt_tokens)
assert second.usage.prompt_tokens < full.usage.prompt_tokens + 100

raw = client.completions.create(
    model="kimi-k3-local", prompt="Once upon a time", max_tokens=12, temperature=0
)
print("raw: Once upon a time" + raw.choices[0].text)
assert raw.usage.completion_tokens == 12

again = client.chat.completions.create(
    model="kimi-k3-local", messages=follow, temperature=0, max_tokens=200
)
assert again.usage.prompt_tokens_details.cached_tokens > 0, again.usage

try:
    client.chat.completions.create(model="kimi-k3-local", messages=question, n=2)
except openai.BadRequestError as e:
    print("bad request:", e.status_code, e.body["message"] if isinstance(e.body, dict) else e)
else:
    raise AssertionError("n=2 was accepted")

print("all checks passed")
