"""A live `ddtree serve` driven with the official openai client: completions, chat, streaming with
usage, per-request tree budgets; greedy output equal to `ddtree generate --json`."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest

from ddtree.models.tokenizer import load_tokenizer
from server_process import API_KEY, LiveServer, quiet_env

PROMPT = "def fib(n):"
MAX_MODEL_LEN = 160


@pytest.fixture(scope="module")
def server(demo_pair):
    with LiveServer(*demo_pair, "--tree-budget", "64", max_model_len=MAX_MODEL_LEN) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def generate_json(demo_pair, *flags: str) -> dict:
    target, draft = demo_pair
    cmd = [sys.executable, "-m", "ddtree.cli", "generate", "--target", str(target), "--draft", str(draft),
           "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN), "--json", *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=quiet_env())
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_health_models_version(server, demo_pair):
    health = httpx.get(server.url + "/health").json()  # no key needed
    assert health["status"] == "ok"
    assert health["target_model"] == demo_pair[0].name and health["draft_model"] == demo_pair[1].name
    assert health["max_draft_len"] == health["block_size"] - 1 > 0
    assert health["tree_budget"] == "64" and health["device"] == "cpu"
    models = httpx.get(server.url + "/v1/models", headers=server.headers).json()
    assert [m["id"] for m in models["data"]] == [server.model]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(server.url + "/version").json()["version"]
    responses = httpx.get(server.url + "/openapi.json").json()["paths"]["/v1/completions"]["post"]["responses"]
    assert "400" in responses and "422" not in responses


def test_greedy_completion_equals_ddtree_generate(server, client, demo_pair):
    reference = generate_json(demo_pair, "--prompt", PROMPT, "--max-tokens", "24", "--temperature", "0",
                              "--tree-budget", "64", "--ignore-eos")
    out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=24, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = out.choices[0]
    assert choice.text == reference["text"]
    assert choice.model_extra["token_ids"] == reference["token_ids"]
    assert choice.model_extra["prompt_token_ids"] == reference["prompt_token_ids"]
    assert choice.finish_reason == reference["finish_reason"] == "length"
    assert out.usage.prompt_tokens == len(reference["prompt_token_ids"])
    assert out.usage.completion_tokens == 24 and out.usage.total_tokens == out.usage.prompt_tokens + 24
    stats = out.model_extra["ddtree"]
    assert stats["tree_budget"] == "64"
    assert stats["decode_rounds"] == reference["stats"]["decode_rounds"]
    assert stats["acceptance_lengths"] == reference["stats"]["acceptance_lengths"]
    assert stats["mean_acceptance_length"] == pytest.approx(reference["stats"]["mean_acceptance_length"])
    assert stats["tokens_per_second"] > 0


def test_completion_from_token_ids(server, client):
    ids = load_tokenizer(client_target(server)).encode(PROMPT)
    by_text = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12, temperature=0)
    by_ids = client.completions.create(model=server.model, prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def client_target(server):
    return server.proc.args[server.proc.args.index("--target") + 1]


@pytest.mark.parametrize("budget", ["ar", "chain", 1, 5, 64])
def test_per_request_tree_budget_is_lossless(server, client, budget):
    kwargs = dict(model=server.model, prompt=PROMPT, max_tokens=20, temperature=0,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
    baseline = client.completions.create(**{**kwargs, "extra_body": {**kwargs["extra_body"], "tree_budget": "ar"}})
    out = client.completions.create(**{**kwargs, "extra_body": {**kwargs["extra_body"], "tree_budget": budget}})
    assert out.choices[0].model_extra["token_ids"] == baseline.choices[0].model_extra["token_ids"]
    assert out.choices[0].text == baseline.choices[0].text
    stats = out.model_extra["ddtree"]
    assert stats["tree_budget"] == str(budget)
    lengths = stats["acceptance_lengths"]  # the prefill gives 1 token, each round its acceptance length
    assert stats["decode_rounds"] == len(lengths) and 1 + sum(lengths[:-1]) < 20 <= 1 + sum(lengths)
    if budget == "ar":
        assert set(stats["acceptance_lengths"]) == {1}


def test_chat_uses_the_chat_template(server, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write fib."}]
    chat = client.chat.completions.create(model=server.model, messages=messages, max_tokens=12, temperature=0,
                                          extra_body={"return_token_ids": True})
    prompt_ids = chat.choices[0].model_extra["prompt_token_ids"]
    assert prompt_ids == load_tokenizer(client_target(server)).apply_chat_template(messages)
    plain = client.completions.create(model=server.model, prompt=prompt_ids, max_tokens=12, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.usage.prompt_tokens == len(prompt_ids)
    assert chat.model_extra["ddtree"]["tree_budget"] == "64"
    # content given as a list of text parts, as `vllm bench serve` sends it
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    again = client.chat.completions.create(model=server.model, messages=parts, max_completion_tokens=12,
                                           temperature=0)
    assert again.choices[0].message.content == chat.choices[0].message.content


def test_streaming_completion_with_usage(server, client):
    whole = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=30, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True, "tree_budget": 4})
    chunks = list(client.completions.create(model=server.model, prompt=PROMPT, max_tokens=30, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True, "return_token_ids": True,
                                                        "tree_budget": 4}))
    usage_chunk, body = chunks[-1], chunks[:-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 30
    assert all(len(c.choices) == 1 for c in body) and all(c.usage is None for c in body)
    assert "".join(c.choices[0].text for c in body) == whole.choices[0].text
    streamed_ids = [t for c in body for t in c.choices[0].model_extra["token_ids"]]
    assert streamed_ids == whole.choices[0].model_extra["token_ids"]
    assert [c.choices[0].finish_reason for c in body][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert body[-1].model_extra["ddtree"]["tree_budget"] == "4"
    assert len({c.id for c in chunks}) == 1


def test_streaming_chat_with_usage(server, client):
    messages = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(model=server.model, messages=messages, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=server.model, messages=messages, max_tokens=16,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    # without include_usage there is no usage chunk
    plain = list(client.chat.completions.create(model=server.model, messages=messages, max_tokens=4,
                                                temperature=0, stream=True))
    assert all(c.choices for c in plain)


def test_sampling_with_a_seed_is_reproducible(server, client):
    kwargs = dict(model=server.model, prompt=PROMPT, max_tokens=16, temperature=0.9, top_p=0.95, seed=7,
                  extra_body={"top_k": 50, "ignore_eos": True})
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text


def test_stop_strings_end_the_text(server, client):
    base = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[5:8]
    assert len(stop) == 3
    out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == base[: base.index(stop)]


def test_api_key_unknown_model_and_n(server, client):
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "x"}).status_code == 401
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2, n=2)
    assert info.value.body["param"] == "n"


@pytest.fixture(scope="module")
def target_logprobs(server):
    """prompt ids, tokens -> the served target's float64 log-softmax at each token's position."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(client_target(server), dtype=torch.float32).eval()

    @torch.no_grad()
    def logprobs(prompt: list[int], tokens: list[int]):
        logits = hf(torch.tensor([prompt + tokens])).logits[0].double()
        return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(tokens) - 1], dim=-1)

    return logprobs


@pytest.mark.parametrize("budget", ["ar", "chain", 4, 64])
def test_logprobs_are_the_targets_at_every_budget(server, client, target_logprobs, budget):
    out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=16, temperature=0.8, seed=3,
                                    logprobs=3, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                            "tree_budget": budget})
    choice = out.choices[0]
    ids, lp = choice.model_extra["token_ids"], choice.logprobs
    expected = target_logprobs(choice.model_extra["prompt_token_ids"], ids)
    assert len(lp.token_logprobs) == len(lp.tokens) == len(ids) == 16
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == choice.text
    for j, token in enumerate(ids):
        assert abs(lp.token_logprobs[j] - float(expected[j, token])) < 1e-4
        best = expected[j].topk(3)
        assert sorted(lp.top_logprobs[j].values(), reverse=True)[:3] == pytest.approx(best.values.tolist(), abs=1e-4)
    chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=8, temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"tree_budget": budget, "return_token_ids": True})
    ids = chat.choices[0].model_extra["token_ids"]
    expected = target_logprobs(chat.choices[0].model_extra["prompt_token_ids"], ids)
    content = chat.choices[0].logprobs.content
    assert len(content) == len(ids)
    for j, entry in enumerate(content):
        assert abs(entry.logprob - float(expected[j, ids[j]])) < 1e-4 and bytes(entry.bytes).decode() == entry.token
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(expected[j].topk(2).values.tolist(), abs=1e-4)


def test_streamed_logprobs_match_the_whole_response(server, client):
    kwargs = dict(model=server.model, messages=[{"role": "user", "content": "hello"}], max_tokens=12, temperature=0,
                  logprobs=True, top_logprobs=1, extra_body={"ignore_eos": True, "tree_budget": "chain"})
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole]
    plain = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None
