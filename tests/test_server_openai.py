"""The OpenAI-compatible endpoints, driven by the unmodified `openai` package: completions,
streamed chat completions, sampling options, automatic prefix reuse, and OpenAI-shaped errors."""
import asyncio
import json
import threading

import httpx
import openai
import pytest
from guests import lip
from prometheus_client.parser import text_string_to_metric_families
from served import SMALL_QUOTAS, TOKENS, served, wait_until  # noqa: F401 (fixture)

from symphony_os.client.client import Client
from symphony_os.engine.sampling import Sample, ScoreEach
from symphony_os.server.completion import BranchText

PROMPT = "Once upon a time"


@pytest.fixture
def api(served):
    with openai.OpenAI(base_url=served.url + "/v1", api_key=TOKENS["carol"], max_retries=0) as client:
        yield client


def test_models_lists_the_served_model(api):
    assert [m.id for m in api.models.list().data] == ["stories260K"]


def test_greedy_completion_equals_the_hello_lip(served, api):
    with Client(served.url, TOKENS["carol"]) as client:
        hello = client.run(client.upload(lip("hello"))["sha256"], [PROMPT, "24"]).output.decode()
    completion = api.completions.create(model="stories260K", prompt=PROMPT, max_tokens=24, temperature=0)
    assert PROMPT + completion.choices[0].text + "\n" == hello
    # The text is decoded after the prompt: a first token keeps its leading space (" upon").
    with Client(served.url, TOKENS["carol"]) as client:
        once = client.run(client.upload(lip("hello"))["sha256"], ["Once", "12"]).output.decode()
    for stop in ([], ["no such stop"]):
        short = api.completions.create(model="stories260K", prompt="Once", max_tokens=12, temperature=0, stop=stop)
        assert "Once" + short.choices[0].text + "\n" == once and short.choices[0].text.startswith(" ")
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.prompt_tokens == len(served.engine.tokenize(PROMPT))
    assert completion.usage.completion_tokens == 24


def test_streamed_chat_equals_the_whole_answer(api):
    messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "A story about a cat"}]
    whole = api.chat.completions.create(model="stories260K", messages=messages, max_tokens=30, temperature=0.9,
                                        top_p=0.95, seed=11)
    stream = api.chat.completions.create(model="stories260K", messages=messages, max_tokens=30, temperature=0.9,
                                         top_p=0.95, seed=11, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.role == "assistant"
    assert text == whole.choices[0].message.content and len(text) > 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_a_streamed_request_is_measured_in_vllms_metrics(served, api):
    """Time to first token, the tokens between, the whole request and how it ended, under vLLM's
    names and the model's name, read back through prometheus_client's parser."""
    def samples() -> dict:
        text = httpx.get(served.url + "/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def count(table: dict, name: str, **labels) -> float:
        wanted = {"model_name": "stories260K", **labels}
        return sum(v for (n, ls), v in table.items() if n == name and wanted.items() <= dict(ls).items())

    before = samples()
    stream = api.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=12, temperature=0,
                                    stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices)
    after = samples()
    ttft = "vllm:time_to_first_token_seconds"
    for name, labels, more in ((f"{ttft}_count", {}, 1), (f"{ttft}_bucket", {"le": "+Inf"}, 1),
                               ("vllm:e2e_request_latency_seconds_count", {}, 1),
                               ("vllm:inter_token_latency_seconds_count", {}, 11),
                               ("vllm:request_success_total", {"finished_reason": "length"}, 1)):
        assert count(after, name, source="openai", **labels) - count(before, name, source="openai", **labels) == more, \
            name
    first_token = count(after, f"{ttft}_sum", source="openai") - count(before, f"{ttft}_sum", source="openai")
    whole = (count(after, "vllm:e2e_request_latency_seconds_sum", source="openai")
             - count(before, "vllm:e2e_request_latency_seconds_sum", source="openai"))
    assert 0 < first_token <= whole
    assert count(after, "vllm:generation_tokens_total") - count(before, "vllm:generation_tokens_total") == 12
    prompt = len(served.engine.tokenize("Once upon a time"))
    assert count(after, "vllm:prefix_cache_queries_total") - count(before, "vllm:prefix_cache_queries_total") == prompt


@pytest.mark.parametrize("params, named", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
     "response_format"),
    (dict(response_format={"type": "yaml"}), "response_format"),
    (dict(tools=[{"type": "function", "function": {"name": "no spaces", "parameters": {"type": "object"}}}]),
     "tools.0"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function",
                                                                              "function": {"name": "g"}}),
     "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}], logprobs=True), "logprobs"),
    (dict(logit_bias={"5": 1000}), "logit_bias"),
    (dict(logit_bias={"not a token": 1}), "logit_bias"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(extra_body={"top_k": -5}), "top_k"),
    (dict(extra_body={"min_p": 1.5}), "min_p"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(extra_body={"guided_json": {"type": "object"}}), "guided_json"),
    (dict(extra_body={"min_tokens": 99}), "min_tokens"),
    (dict(extra_body={"no_such_parameter": 1}), "no_such_parameter"),
    (dict(messages=[{"role": "user", "content": "hi", "audio": "x"}]), "messages.0.audio"),
])
def test_a_parameter_the_server_would_ignore_is_a_400_naming_it(api, params, named):
    """The endpoint never drops a parameter silently (an agent that sends `tools` must not get
    prose back): what it does not act on is refused, unless given at the value that asks for
    nothing."""
    arguments = dict(model="stories260K", messages=[{"role": "user", "content": "Hello"}], max_tokens=4) | params
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(**arguments)
    assert refused.value.body["param"] == named and named.rpartition(".")[2] in refused.value.body["message"]


def test_neutral_values_of_unsupported_parameters_are_taken(api):
    answer = api.chat.completions.create(
        model="stories260K", messages=[{"role": "user", "content": "Hello", "name": "tim"}], max_tokens=4,
        presence_penalty=0, frequency_penalty=0.0, logit_bias={}, response_format={"type": "text"}, user="u-1",
        extra_body={"top_k": -1, "min_p": 0, "repetition_penalty": 1.0, "ignore_eos": False})
    assert answer.choices[0].message.content is not None


def test_stop_n_seed_and_logprobs(api):
    greedy = api.completions.create(model="stories260K", prompt=PROMPT, max_tokens=30, temperature=0).choices[0].text
    stop = greedy.split()[4]
    stopped = api.completions.create(model="stories260K", prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop])
    assert stopped.choices[0].text == greedy[:greedy.index(stop)] and stopped.choices[0].finish_reason == "stop"
    streamed = api.completions.create(model="stories260K", prompt=PROMPT, max_tokens=30, temperature=0, stop=stop,
                                      stream=True)
    assert "".join(c.choices[0].text for c in streamed) == stopped.choices[0].text

    sampled = [api.completions.create(model="stories260K", prompt=PROMPT, max_tokens=12, temperature=1.0, n=3,
                                      seed=5) for _ in range(2)]
    assert [c.text for c in sampled[0].choices] == [c.text for c in sampled[1].choices]
    assert [c.index for c in sampled[0].choices] == [0, 1, 2] and len({c.text for c in sampled[0].choices}) > 1

    scored = api.completions.create(model="stories260K", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == greedy[:len(scored.choices[0].text)]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(len(top) <= 3 and max(top.values()) == pytest.approx(chosen, abs=1e-5)
               for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    chat = api.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    assert len(chat.choices[0].logprobs.content) == 4
    assert all(len(t.top_logprobs) == 2 for t in chat.choices[0].logprobs.content)
    # Each token's text is what it adds to the text (decoded alone, one lost its leading space),
    # so they join into the text, and text_offset indexes it, streamed or not.
    assert "".join(lp.tokens) == scored.choices[0].text
    assert all(scored.choices[0].text[at:].startswith(token) for at, token in zip(lp.text_offset, lp.tokens))
    streamed = list(api.completions.create(model="stories260K", prompt=PROMPT, max_tokens=6, temperature=0,
                                           logprobs=3, stream=True))
    assert [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [o for c in streamed if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset] == lp.text_offset
    assert "".join(t.token for t in chat.choices[0].logprobs.content) == chat.choices[0].message.content
    assert all(t.top_logprobs[0].token == t.token for t in chat.choices[0].logprobs.content)


def test_identical_prompt_prefixes_reuse_kv_pages(served, api):
    story = ("Tim and his big brown dog ran down the hill to the river. They saw a frog on a log and a duck "
             "in the water.")  # no other test's prompt starts like this
    assert len(served.engine.tokenize(story)) > 32  # more than two pages of 16
    first = api.completions.create(model="stories260K", prompt=story, max_tokens=10, temperature=0)
    second = api.completions.create(model="stories260K", prompt=story, max_tokens=10, temperature=0)
    other = api.completions.create(model="stories260K", prompt=story + " One day", max_tokens=10, temperature=0)
    cached = [c.usage.prompt_tokens_details.cached_tokens for c in (first, second, other)]
    assert cached[0] == 0 and cached[1] >= 32 and cached[2] >= cached[1]
    assert first.choices[0].text == second.choices[0].text
    metrics = httpx.get(served.url + "/metrics").text
    assert "symphony_completion_cached_tokens_total 0.0\n" not in metrics
    requests, generated = (float(metrics.split(f"\n{name} ")[1].split()[0]) for name in
                           ("symphony_completion_requests_total", "symphony_completion_tokens_total"))
    assert requests >= 3 and generated >= 30
    # The cache belongs to the tenant: another tenant's identical prompt starts cold.
    with openai.OpenAI(base_url=served.url + "/v1", api_key=TOKENS["dave"], max_retries=0) as dave:
        theirs = dave.completions.create(model="stories260K", prompt=story, max_tokens=10, temperature=0)
    assert theirs.usage.prompt_tokens_details.cached_tokens == 0
    assert theirs.choices[0].text == first.choices[0].text


def test_bad_requests_get_openai_errors(served, api):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        api.completions.create(model="gpt-4", prompt=PROMPT)
    for bad in (dict(temperature=5), dict(n=0), dict(max_tokens=-1), dict(top_p=0), dict(logprobs=50),
                dict(prompt=[10**9]), dict(prompt=[]), dict(stop=[""]), dict(top_p=1e-46), dict(top_p=1e39)):
        with pytest.raises(openai.BadRequestError):
            api.completions.create(**{"model": "stories260K", "prompt": PROMPT, **bad})
    with pytest.raises(openai.BadRequestError, match="messages"):
        api.chat.completions.create(model="stories260K", messages=[])
    with openai.OpenAI(base_url=served.url + "/v1", api_key="wrong", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError):
            stranger.models.list()
    response = httpx.post(served.url + "/v1/completions", content=b"{oops",
                          headers={"Authorization": f"Bearer {TOKENS['carol']}"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]


@pytest.fixture
def small_api(served):
    """The tenant with room for 8 KV pages of 16 tokens."""
    with openai.OpenAI(base_url=served.url + "/v1", api_key=TOKENS["small"], max_retries=0) as client:
        yield client


def test_the_prefix_cache_counts_against_the_tenants_kv_page_quota(served, small_api):
    words = "cat dog sun tree ball bird fish frog duck cow pig hen".split()
    prompts = [" ".join(f"{w}{i}" for w in words) for i in range(6)]
    assert all(len(served.engine.tokenize(p)) > 32 for p in prompts)  # each caches 3 pages of its own
    used_before = served.engine.pool.stats().used
    for prompt in prompts:
        small_api.completions.create(model="stories260K", prompt=prompt, max_tokens=8, temperature=0)
    assert served.engine.pool.stats().used - used_before <= SMALL_QUOTAS["max_kv_pages"]
    assert served.engine.kvfs.pages_of("small") <= SMALL_QUOTAS["max_kv_pages"]
    again = small_api.completions.create(model="stories260K", prompt=prompts[-1], max_tokens=8, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 32  # its oldest blocks went first


def test_forked_pages_count_once_and_a_kv_quota_refusal_is_a_403(served, small_api):
    prompt = "Sam the kid saw a big fish in the pond and he ran home to tell his mom and dad about"
    assert 32 < len(served.engine.tokenize(prompt)) <= 48 - 6  # 3 pages, the last one partly filled
    # The branches share the prompt's pages and copy only its last: 5 distinct pages, 9 per file.
    two = small_api.completions.create(model="stories260K", prompt=prompt, max_tokens=6, n=2, seed=1)
    assert len(two.choices) == 2
    with pytest.raises(openai.PermissionDeniedError, match="KV page quota") as refused:
        small_api.completions.create(model="stories260K", prompt=prompt, max_tokens=60, n=4, seed=1)
    assert refused.value.body["type"] == "quota_exceeded"


def test_branch_text_decodes_each_token_once(served):
    ids = served.engine.tokenize("Once upon a time, there was a little girl named Lily. " * 12,
                                 add_special_tokens=False)
    decoded_ids = []

    def detokenize(part: list[int]) -> str:
        decoded_ids.append(len(part))
        return served.engine.detokenize(part)

    branch = BranchText(detokenize, stops=("Lily went",))
    streamed = "".join(branch.add(token) for token in ids)
    assert streamed + branch.finish(None) == served.engine.detokenize(ids)
    assert sum(decoded_ids) < 10 * len(ids)  # a few ids per token, not the whole branch each time


def test_chat_answers_are_as_long_as_the_context_allows_by_default(api):
    messages = [{"role": "user", "content": "Tell me a long story about a dog"}]
    capped = api.chat.completions.create(model="stories260K", messages=messages, max_tokens=20, temperature=0)
    assert capped.choices[0].finish_reason == "length"  # the greedy answer is longer than 20 tokens
    default = api.chat.completions.create(model="stories260K", messages=messages, temperature=0)
    assert default.usage.completion_tokens > 20
    assert default.choices[0].message.content.startswith(capped.choices[0].message.content)


def test_a_request_body_over_4_mib_is_refused_before_parsing(served):
    body = b" " * (5 << 20) + b'{"model": "stories260K", "prompt": "Hi", "max_tokens": 1}'
    response = httpx.post(served.url + "/v1/completions", content=body,
                          headers={"Authorization": f"Bearer {TOKENS['carol']}", "Content-Type": "application/json"})
    assert response.status_code == 413 and "request body" in response.json()["error"]["message"]


def test_logprobs_come_with_every_sampling_option_and_change_no_draw(served, api):
    """Log-probabilities are the model's own, reported beside the draw: asking for them changes
    no token (a seeded draw included), and they come with a logit bias, a penalty, min-p and a
    grammar (response_format), which act on the draw alone."""
    base = dict(model="stories260K", prompt=PROMPT, max_tokens=10)
    for seed in range(3):
        plain = api.completions.create(**base, temperature=0.9, seed=seed).choices[0].text
        scored = api.completions.create(**base, temperature=0.9, seed=seed, logprobs=2).choices[0]
        assert scored.text == plain and len(scored.logprobs.token_logprobs) == 10
    forced = served.engine.tokenize(" dragon", add_special_tokens=False)[-1]
    biased = api.completions.create(**base | dict(max_tokens=3), temperature=0, logprobs=1,
                                    logit_bias={str(forced): 100}, extra_body={"repetition_penalty": 1.3, "min_p": 0.05})
    lp = biased.choices[0].logprobs
    # the bias forced the token; its log-probability is the model's, far below the top one's
    assert len(lp.token_logprobs) == 3 and all(chosen < max(top.values()) for chosen, top in
                                                 zip(lp.token_logprobs, lp.top_logprobs))
    shaped = api.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "Hello"}],
                                         max_tokens=30, temperature=0, logprobs=True, top_logprobs=2,
                                         response_format={"type": "json_object"})
    content = shaped.choices[0].message.content
    assert content.startswith("{") and "".join(t.token for t in shaped.choices[0].logprobs.content) == content


def _post_raw(served, path: str, body: str) -> httpx.Response:
    return httpx.post(served.url + path, content=body.encode(), timeout=60,
                      headers={"Authorization": f"Bearer {TOKENS['carol']}", "Content-Type": "application/json"})


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", '{"model": "stories260K", "prompt": "Hi \\ud800", "max_tokens": 2}'),
    ("/v1/completions", '{"model": "stories260K", "prompt": "Hi", "max_tokens": 2, "stop": ["\\ud800"]}'),
    ("/v1/chat/completions", '{"model": "stories260K", "messages": [{"role": "user", "content": "\\udfff"}]}'),
])
def test_a_lone_surrogate_is_a_400_and_leaves_no_process(served, path, body):
    """Valid JSON, not encodable text: in `stop` it failed after the completion process had
    started, and left it running, attached, forever (counted against the tenant's processes)."""
    table = served.app.state.symphony.table
    before = {record.pid for record in table.list("carol")}
    response = _post_raw(served, path, body)
    assert response.status_code == 400 and "surrogate" in response.json()["error"]["message"], response.text
    assert {record.pid for record in table.list("carol") if record.running} <= before


def test_json_nested_too_deep_is_a_400(served):
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = _post_raw(served, path, "[" * 10000 + "]" * 10000)
        assert response.status_code == 400 and "JSON" in response.json()["error"]["message"], response.text


def test_a_process_limit_reached_by_a_completion_is_a_403(served):
    """A tenant's per-process limits (here its output) stop the completion's process: a quota
    refusal like the others, not a server error."""
    with openai.OpenAI(base_url=served.url + "/v1", api_key=TOKENS["terse"], max_retries=0) as terse:
        with pytest.raises(openai.PermissionDeniedError, match="output limit"):
            terse.completions.create(model="stories260K", prompt=PROMPT, max_tokens=200, temperature=0, logprobs=5)
        stream = terse.completions.create(model="stories260K", prompt=PROMPT, max_tokens=200, temperature=0,
                                          logprobs=5, stream=True)
        with pytest.raises(openai.APIError, match="output limit"):
            list(stream)


def test_concurrent_streams_over_the_process_quota_are_refused_with_a_403(served):
    """The quota was checked when a stream was asked for and the process started when it
    began: concurrent streams all passed the check, then failed inside a 200 stream."""
    async def ask(client: httpx.AsyncClient) -> tuple[int, str]:
        body = {"model": "stories260K", "prompt": PROMPT, "max_tokens": 12, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {TOKENS['tight']}"}) as response:
            return response.status_code, (await response.aread()).decode()

    async def all_at_once():
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
            return await asyncio.gather(*(ask(client) for _ in range(4)))

    answers = asyncio.run(all_at_once())
    assert all(status == 403 or (status == 200 and '"error"' not in text) for status, text in answers), answers
    assert any(status == 200 for status, _ in answers) and any(status == 403 for status, _ in answers)


def test_a_completion_whose_client_left_is_stopped(served, monkeypatch):
    """A non-streamed request ran to its end (seconds of decoding, hundreds of KV pages) after
    its client had given up; now its process is killed once the client is gone. No forward
    pass runs until then, so the request cannot end first however fast the machine is."""
    table = served.app.state.symphony.table
    before = {record.pid for record in table.list("carol", include_ended=True)}
    gate, run = threading.Event(), served.engine.runner.run

    def held_back(seqs):
        gate.wait(60)
        return run(seqs)

    monkeypatch.setattr(served.engine.runner, "run", held_back)
    body = {"model": "stories260K", "prompt": PROMPT, "max_tokens": 400, "n": 16, "temperature": 1}
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(served.url + "/v1/completions", json=body, timeout=0.5,
                       headers={"Authorization": f"Bearer {TOKENS['carol']}"})
        [record] = [r for r in table.list("carol", include_ended=True) if r.pid not in before]
        assert wait_until(lambda: record.process.end_reason is not None, timeout_s=60)
    finally:
        gate.set()
    assert "the request went away" in record.process.end_reason


def test_a_stream_starts_before_the_prompts_forward_pass(served, monkeypatch):
    """The response's headers (and a chat's role chunk) went out only with the first token,
    after the prompt's forward pass: a long prompt left the client with nothing, not even a
    status. Here no forward pass may run until the stream has started."""
    gate, run = threading.Event(), served.engine.runner.run

    def held_back(seqs):
        assert gate.wait(20), "the stream never started"
        return run(seqs)

    monkeypatch.setattr(served.engine.runner, "run", held_back)
    body = {"model": "stories260K", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
            "stream": True}
    with httpx.stream("POST", served.url + "/v1/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {TOKENS['carol']}"}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        first = next(line for line in lines if line)
        assert not gate.is_set()  # no token yet: the stream began before any forward pass
        assert json.loads(first.removeprefix("data: "))["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        gate.set()
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and any('"content"' in line for line in rest[:-1])


def test_tokenize_detokenize_version_and_unknown_routes(served, api):
    """vLLM's /tokenize (a prompt, or messages through the chat template) and /detokenize, /version
    without a token, and an unknown /v1 route answered in OpenAI's shape."""
    headers = {"Authorization": f"Bearer {TOKENS['alice']}"}
    prompt = served.engine.tokenize("Once upon a time")
    answer = httpx.post(served.url + "/tokenize", json={"model": "stories260K", "prompt": "Once upon a time"},
                        headers=headers).json()
    assert answer == {"count": len(prompt), "max_model_len": served.engine.max_model_len, "tokens": prompt}
    chat = httpx.post(served.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]},
                      headers=headers).json()
    streamed = api.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=1)
    assert chat["count"] == streamed.usage.prompt_tokens
    assert httpx.post(served.url + "/detokenize", json={"tokens": prompt}, headers=headers).json() == \
        {"prompt": served.engine.detokenize(prompt)}
    refused = httpx.post(served.url + "/detokenize", json={"tokens": [10**9]}, headers=headers)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens"
    assert httpx.post(served.url + "/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.get(served.url + "/version").json()["version"]
    with pytest.raises(openai.NotFoundError) as missing:
        api.embeddings.create(model="stories260K", input="hello")
    assert "/v1/embeddings" in missing.value.body["message"]


@pytest.mark.parametrize("name", ["nested object with required fields", "enum and boolean", "array of bounded items"])
def test_response_format_json_schema_answers_json_the_schema_accepts(api, name):
    """Structured output through the grammar call: json.loads takes the answer and it conforms,
    for nested objects, enums, arrays and required fields, with n = 2 (each branch its own
    grammar) and streamed alike."""
    from test_grammar import SCHEMAS, conforms

    schema = SCHEMAS[name]
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "Describe a pet as JSON."}]
    answer = api.chat.completions.create(model="stories260K", messages=messages, max_tokens=300, temperature=0.8,
                                         seed=5, n=2, response_format=response_format)
    for choice in answer.choices:
        assert choice.finish_reason == "stop" and conforms(json.loads(choice.message.content), schema), choice
    stream = api.chat.completions.create(model="stories260K", messages=messages, max_tokens=300, temperature=0,
                                         response_format=response_format, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert conforms(json.loads(text), schema), text
    # json_object: any object (this tiny model may write one string until max_tokens; what it
    # writes is an object's start, whole once it stops).
    whole = api.completions.create(model="stories260K", prompt=PROMPT, max_tokens=60, temperature=0,
                                   extra_body={"response_format": {"type": "json_object"}}).choices[0]
    assert whole.text.startswith("{")
    assert whole.finish_reason == "length" or isinstance(json.loads(whole.text), dict)


# Small: stories260K's context is 512 tokens, and its tokenizer spends many on JSON.
WEATHER = {"type": "function", "function": {
    "name": "weather", "parameters": {"type": "object", "additionalProperties": False, "required": ["unit"],
                                      "properties": {"unit": {"enum": ["C", "F"]}}}}}
TIME = {"type": "function", "function": {
    "name": "time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                   "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}


def test_tools_with_a_required_or_named_call_answer_tool_calls_whose_arguments_fit(api):
    """tool_choice "required" or a named function: the answer is a call (a grammar holds it to
    the functions' schemas), parsed into tool_calls; "none" answers in text; auto either."""
    from test_grammar import conforms

    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    answer = api.chat.completions.create(model="stories260K", messages=messages, max_tokens=100, temperature=0.7,
                                         seed=1, n=2, tools=[WEATHER, TIME], tool_choice="required")
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        [call] = choice.message.tool_calls
        tool = {"weather": WEATHER, "time": TIME}[call.function.name]
        assert call.type == "function" and call.id.startswith("call_")
        assert conforms(json.loads(call.function.arguments), tool["function"]["parameters"]), call
    named = api.chat.completions.create(model="stories260K", messages=messages, max_tokens=100, temperature=0,
                                        tools=[WEATHER, TIME],
                                        tool_choice={"type": "function", "function": {"name": "time"}})
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    none = api.chat.completions.create(model="stories260K", messages=messages, max_tokens=10, temperature=0,
                                       tools=[WEATHER], tool_choice="none")
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content
    auto = api.chat.completions.create(model="stories260K", messages=messages, max_tokens=40, temperature=0,
                                       tools=[WEATHER])
    message = auto.choices[0].message
    assert (message.tool_calls is None) != (message.content is None)
    # Streamed: the call comes whole, in one delta.
    stream = api.chat.completions.create(model="stories260K", messages=messages, max_tokens=100, temperature=0,
                                         tools=[WEATHER], tool_choice="required", stream=True)
    deltas = [chunk.choices[0] for chunk in stream if chunk.choices]
    [call] = [c for d in deltas for c in (d.delta.tool_calls or [])]
    assert deltas[-1].finish_reason == "tool_calls"
    assert conforms(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_a_conversation_with_a_tool_call_and_its_answer_goes_on(api):
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "weather", "arguments": '{"unit": "C"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}]
    answer = api.chat.completions.create(model="stories260K", messages=messages, max_tokens=12, temperature=0,
                                         tools=[WEATHER], tool_choice="none")
    assert answer.choices[0].message.content and answer.usage.prompt_tokens > 20


def test_top_k_logit_bias_penalties_ignore_eos_and_min_tokens(served, api):
    """The sampling options the complete LIP acts on: top_k 1 is greedy at any temperature; a
    logit bias of +100 makes its token win; a presence penalty keeps a greedy answer from
    repeating itself; min_tokens holds EOS back and ignore_eos goes past it."""
    base = dict(model="stories260K", prompt=PROMPT, max_tokens=40)
    greedy = api.completions.create(**base, temperature=0).choices[0].text
    top1 = api.completions.create(**base, temperature=1.5, seed=3, extra_body={"top_k": 1}).choices[0].text
    assert top1 == greedy
    forced = served.engine.tokenize(" dragon", add_special_tokens=False)[-1]
    biased = api.completions.create(**base | dict(max_tokens=5), temperature=0, logit_bias={str(forced): 100})
    assert served.engine.tokenize(biased.choices[0].text, add_special_tokens=False) == [forced] * 5 or \
        biased.choices[0].text == served.engine.detokenize([forced] * 5)
    words = greedy.split()
    assert len(words) > len(set(words))  # the greedy story repeats words ...
    penalized = api.completions.create(**base, temperature=0, presence_penalty=2.0, frequency_penalty=2.0)
    ids = served.engine.tokenize(penalized.choices[0].text, add_special_tokens=False)
    assert penalized.choices[0].text != greedy and len(set(ids)) > 0.8 * len(ids)  # ... the penalized one hardly
    eos = {str(served.engine.loaded.eos_token_ids[0]): 100}  # EOS made the greedy choice: the answer ends at once
    ended = api.completions.create(**base, temperature=0, logit_bias=eos).choices[0]
    assert ended.finish_reason == "stop" and ended.text == ""
    held = api.completions.create(**base, temperature=0, logit_bias=eos, extra_body={"min_tokens": 5})
    assert held.usage.completion_tokens == 5 and held.choices[0].finish_reason == "stop"
    past = api.completions.create(**base | dict(max_tokens=7), temperature=0, logit_bias=eos,
                                  extra_body={"ignore_eos": True})
    assert past.usage.completion_tokens == 7 and past.choices[0].finish_reason == "length"


def test_min_p_and_the_repetition_penalty(served, api):
    """min_p 1 keeps the best token alone: greedy at any temperature. The repetition penalty is
    vLLM's, on the prompt's tokens and the answer's so far: the answer is the engine's own
    greedy decoding under that penalty, step by step (and repeats itself less than greedy)."""
    engine = served.engine
    prompt = engine.tokenize(PROMPT)
    base = dict(model="stories260K", prompt=prompt, max_tokens=40)
    greedy = api.completions.create(**base, temperature=0).choices[0].text
    assert api.completions.create(**base, temperature=1.5, seed=3, extra_body={"min_p": 1.0}).choices[0].text == greedy
    penalized = api.completions.create(**base, temperature=0, extra_body={"repetition_penalty": 3.0}).choices[0]
    kv = engine.session()
    handle, seen, feed, expected = kv.create(), list(prompt), prompt, []
    for _ in range(40):
        token = engine.pred(kv, handle, feed, want=Sample(repetition_penalty=3.0, penalized=tuple(seen))).token
        if token in engine.loaded.eos_token_ids:
            break
        expected.append(token)
        seen.append(token)
        feed = [token]
    kv.close_all()
    context = engine.detokenize(prompt[-1:])  # (an answer's text is decoded after the prompt's last token)
    assert penalized.text == engine.detokenize(prompt[-1:] + expected)[len(context):] and penalized.text != greedy


def test_several_prompts_in_one_completions_request(api):
    """A list of prompts: a process each, their choices in prompt order (n each), usage summed,
    streamed alike; each the same as the prompt's own request."""
    prompts = [PROMPT, "The little dog"]
    alone = [api.completions.create(model="stories260K", prompt=p, max_tokens=12, temperature=0) for p in prompts]
    both = api.completions.create(model="stories260K", prompt=prompts, max_tokens=12, temperature=0, n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert both.usage.completion_tokens == 4 * 12
    stream = api.completions.create(model="stories260K", prompt=[[1, 2, 3], [1, 5, 9, 12]], max_tokens=6,
                                    temperature=0, stream=True)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    tokens = api.completions.create(model="stories260K", prompt=[1, 2, 3], max_tokens=6, temperature=0)
    assert texts == {0: tokens.choices[0].text,
                     1: api.completions.create(model="stories260K", prompt=[1, 5, 9, 12], max_tokens=6,
                                               temperature=0).choices[0].text}


def test_echo_puts_the_prompt_before_the_completion(api):
    plain = api.completions.create(model="stories260K", prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    echoed = api.completions.create(model="stories260K", prompt=PROMPT, max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain
    stream = api.completions.create(model="stories260K", prompt=PROMPT, max_tokens=8, temperature=0, echo=True,
                                    stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == PROMPT + plain


def test_echo_with_logprobs_scores_the_prompt(served, api):
    """lm-eval's loglikelihood request (echo, logprobs, max_tokens 0) and a completion after an
    echo: the prompt's first token has no log-probability, each other one the engine's own score
    of it given those before it; streamed, the echo chunk carries them."""
    engine = served.engine
    ids = engine.tokenize(PROMPT)
    kv = engine.session()
    expected = engine.pred(kv, kv.create(), ids, want=ScoreEach(2))
    kv.close_all()
    scored = api.completions.create(model="stories260K", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2).choices[0]
    lp = scored.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(expected.scores, abs=1e-5)
    assert "".join(lp.tokens) == scored.text and lp.text_offset[0] == 0 and len(lp.tokens) == len(ids)
    assert all(len(top) <= 2 for top in lp.top_logprobs[1:])
    plain = api.completions.create(model="stories260K", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1)
    both = api.completions.create(model="stories260K", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1,
                                  echo=True).choices[0]
    assert both.text == scored.text + plain.choices[0].text  # the answer as without the echo
    assert both.logprobs.tokens == lp.tokens + plain.choices[0].logprobs.tokens
    assert both.logprobs.token_logprobs[len(ids):] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert both.logprobs.text_offset[len(ids)] == len(scored.text)
    chunks = list(api.completions.create(model="stories260K", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1,
                                         echo=True, stream=True))
    assert chunks[0].choices[0].text == scored.text
    assert chunks[0].choices[0].logprobs.token_logprobs[1:] == pytest.approx(expected.scores, abs=1e-5)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == both.text
    streamed = [t for c in chunks[1:] if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.text_offset]
    assert streamed == both.logprobs.text_offset[len(ids):]
