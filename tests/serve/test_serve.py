"""`ortspec serve`: the OpenAI-compatible server.

Fast tests check the pieces without a model: request checking (OpenAI's error shape, with the
field, the value and what is allowed), stop strings across piece boundaries and the tokens they
end after, the admission queue. The slow tests start the server in a subprocess on the real
default model and talk to it with the official `openai` client and raw HTTP: temperature-0 (and
seeded) text equal to `Model.generate` in-process, a stop string's exact usage and speculative
section, malformed requests answered 4xx while the server keeps serving, concurrent clients, a
client that disconnects mid-stream or before a non-streamed answer (the decode stops and its
slot is freed), a full queue (503 + Retry-After) and SIGTERM during a stream (the stream
finishes, exit status 0); and, with Ray installed, two Ray Serve replicas through the openai
client.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")

from ortspec.runtime.ort.manifest import ChatFormat  # noqa: E402
from ortspec.runtime.serve.engine import Admission, QueueFull  # noqa: E402
from ortspec.runtime.serve.protocol import ApiError, ModelInfo, parse_chat, parse_completion  # noqa: E402
from ortspec.runtime.serve.stops import StopMatcher, tokens_through  # noqa: E402
from helpers.serve import Server  # noqa: E402
from helpers.threads import in_threads  # noqa: E402

# -- without a model ------------------------------------------------------------------------------

FAKE = ModelInfo(name="m", capacity=64, vocab_size=100,
                 chat_format=ChatFormat(message="<{role}>{content};", generation_prompt="<assistant>"),
                 encode=lambda text: [ord(c) % 100 for c in text])


def _error(parse, body) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(body, FAKE)
    return e.value


def test_chat_messages_render_through_the_chat_format_multi_turn():
    body = {"model": "m", "messages": [{"role": "system", "content": "s"},
                                       {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                       {"role": "assistant", "content": "yo"},
                                       {"role": "user", "content": "q"}],
            "temperature": 0, "max_tokens": 3, "stop": "x", "seed": 5}
    r = parse_chat(body, FAKE)
    assert r.prompt_ids == FAKE.encode("<system>s;<user>hi;<assistant>yo;<user>q;<assistant>")
    assert (r.options.max_new_tokens, r.options.temperature, r.options.seed) == (3, 0.0, 5)
    assert r.stop == ("x",) and not r.stream


def test_completion_defaults_and_token_id_prompts():
    r = parse_completion({"model": "m", "prompt": [1, 2, 3], "top_p": 1, "top_k": -1}, FAKE)
    assert r.prompt_ids == [1, 2, 3] and r.options.max_new_tokens == 16  # OpenAI's default
    assert r.options.top_p is None and r.options.top_k is None and r.options.temperature == 1.0
    # without max_tokens a chat reply may fill the context: capacity + 1 - prompt
    assert parse_chat({"model": "m", "messages": [{"role": "user", "content": "a"}]},
                      FAKE).options.max_new_tokens == 65 - len(FAKE.encode("<user>a;<assistant>"))


@pytest.mark.parametrize("body, param, words", [
    ([1, 2], None, "JSON object"),
    ({"prompt": "a"}, "model", "required"),
    ({"model": "m", "prompt": "a", "temperature": -0.5}, "temperature", "between 0 and 2, got -0.5"),
    ({"model": "m", "prompt": "a", "temperature": 3}, "temperature", "between 0 and 2, got 3"),
    ({"model": "m", "prompt": "a", "temperature": "hot"}, "temperature", 'number, got "hot"'),
    ({"model": "m", "prompt": "a", "top_p": 0}, "top_p", "(0, 1], got 0"),
    ({"model": "m", "prompt": "a", "top_p": 1.5}, "top_p", "(0, 1], got 1.5"),
    ({"model": "m", "prompt": "a", "top_k": 0}, "top_k", "-1 (no limit) or an integer >= 1, got 0"),
    ({"model": "m", "prompt": "a", "top_k": -2}, "top_k", "-1 (no limit) or an integer >= 1, got -2"),
    ({"model": "m", "prompt": "a", "n": 2}, "n", "n must be 1"),
    ({"model": "m", "prompt": "a", "max_tokens": 0}, "max_tokens", ">= 1, got 0"),
    ({"model": "m", "prompt": "a", "max_tokens": 70}, "max_tokens", "70, but at most 64"),
    ({"model": "m", "prompt": list(range(65))}, "prompt", "65 tokens; this model's context holds at most 64"),
    ({"model": "m", "prompt": [1, 100]}, "prompt", "token id 100 is outside the vocabulary (0..99)"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt", "one prompt per request"),
    ({"model": "m", "prompt": "a", "stop": [1]}, "stop", "string or a list of strings"),
    ({"model": "m", "prompt": "a", "stream": "yes"}, "stream", "true or false"),
    ({"model": "m", "prompt": "a", "logprobs": 2}, "logprobs", "not supported"),
    # a count in /v1/completions: 0 still asks for the chosen tokens' logprobs
    ({"model": "m", "prompt": "a", "logprobs": 0}, "logprobs", "not supported by this server (got 0)"),
    ({"model": "m", "prompt": "a", "frobnicate": 1}, "frobnicate",
     'unrecognized request field "frobnicate"; this route takes max_tokens, model, n, prompt'),
    ({"model": "m", "prompt": "a", "messages": []}, "messages", "unrecognized"),
    ({"model": "m", "prompt": "a", "speculative": {"drafter": "none"}}, "speculative",
     "a field of the response, not of a request"),
    ({"model": "m", "prompt": "a", "stream_options": {"include_usage": True}}, "stream_options",
     "only allowed when stream is true"),
])
def test_bad_completion_requests_name_the_field_and_the_allowed_values(body, param, words):
    e = _error(parse_completion, body)
    assert (e.status, e.param) == (400, param) and words in e.message, e.message
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}


def test_an_unknown_model_is_404_and_bad_messages_name_their_index():
    e = _error(parse_chat, {"model": "gpt-4", "messages": [{"role": "user", "content": "a"}]})
    assert (e.status, e.code) == (404, "model_not_found") and '"m"' in e.message
    e = _error(parse_chat, {"model": "m", "messages": [{"role": "user", "content": "a"},
                                                       {"role": "tool", "content": "b"}]})
    assert e.param == "messages[1].role" and '"tool"' in e.message
    for role in ("system", "developer", "user", "assistant"):  # every role a chat may hold
        assert role in e.message.partition(", got")[0]
    assert _error(parse_chat, {"model": "m", "messages": []}).param == "messages"


def test_chat_fields_that_change_nothing_pass_and_unknown_ones_are_refused():
    chat = {"model": "m", "messages": [{"role": "user", "content": "a"}], "max_tokens": 2}
    # OpenAI's bookkeeping fields, and unsupported ones at the values that mean "unused"
    quiet = {"user": "u", "metadata": {"k": "v"}, "store": False, "parallel_tool_calls": True,
             "logprobs": False, "top_logprobs": 0, "tools": [], "tool_choice": "none",
             "response_format": {"type": "text"}, "verbosity": "medium",
             "prompt_cache_retention": "24h", "ignore_eos": False, "min_tokens": 0, "min_p": 0.0,
             "repetition_penalty": 1.0, "chat_template_kwargs": {}}
    assert parse_chat({**chat, **quiet}, FAKE).options.max_new_tokens == 2
    for field, value, param in [("logprobs", True, "logprobs"), ("tool_choice", "required",
                                 "tool_choice"), ("echo", True, "echo"), ("prompt", "x", "prompt"),
                                ("best_of", 1, "best_of"), ("reasoning_effort", "low",
                                                            "reasoning_effort"),
                                ("ignore_eos", True, "ignore_eos"), ("min_tokens", 8, "min_tokens"),
                                ("logprobs", 0, "logprobs"), ("top_logprobs", False,
                                                              "top_logprobs")]:
        e = _error(parse_chat, {**chat, field: value})
        assert (e.status, e.param) == (400, param), (field, e.message)
    # values appear as the client wrote them (JSON), not as Python prints them
    e = _error(parse_chat, {**chat, "response_format": {"type": "json_object"}})
    assert '{"type": "json_object"}' in e.message, e.message
    e = _error(parse_chat, {**chat, "stop": None, "stream": None, "n": True})
    assert e.param == "n" and "got true" in e.message, e.message


def test_stop_strings_match_across_pieces_and_are_not_emitted():
    m = StopMatcher(["END", "\n\n"])
    assert m.feed("Hello E") == "Hello "  # "E" may begin "END": held back
    assert m.feed("x") == "Ex"  # it did not
    assert m.feed("yE") == "y" and m.feed("N") == "" and m.feed("D tail") == ""
    assert m.stopped and m.flush() == ""
    m = StopMatcher(["abc"])
    assert m.feed("xab") == "x" and m.flush() == "ab"  # the text ended: "ab" was no stop
    m = StopMatcher(["bc", "abcd"])
    assert m.feed("xab") == "x" and m.feed("cd") == ""  # "abcd" begins before "bc": it wins


def test_a_stop_names_the_text_through_it_and_the_tokens_that_made_that_text():
    m = StopMatcher(["END", "\n\n"])
    for piece in ("He", "llo E", "ND and more"):
        m.feed(piece)
    assert m.stopped and m.through == "Hello END"
    m = StopMatcher(["bc", "b"])
    assert m.feed("abcd") == "a" and m.through == "ab"  # same start: the shorter one ends first
    vocab = {1: "He", 2: "llo", 3: " E", 4: "N", 5: "D a", 6: "nd", 7: "\ufffd"}
    decode = lambda ids: "".join(vocab[i] for i in ids)  # noqa: E731
    tokens = [1, 2, 3, 4, 5, 6]  # token 5 ("D a") completes "END"; token 6 comes after it
    assert tokens_through(decode, tokens, "Hello END") == 5
    assert tokens_through(decode, tokens, "Hello E") == 3
    assert tokens_through(decode, tokens, "He") == 1 and tokens_through(decode, tokens, "") == 0
    assert tokens_through(decode, [1, 7], "He\ufffdx") == 2  # no prefix fits: all of them


def test_admission_runs_then_queues_then_refuses_and_hands_places_on_in_order():
    async def scenario():
        adm = Admission(max_running=1, max_waiting=1)
        first, second = adm.ticket(), adm.ticket()
        with pytest.raises(QueueFull, match="1 requests are running and 1 waiting"):
            adm.ticket()
        await first.wait()
        assert (adm.running, adm.waiting) == (1, 1)
        waiter = asyncio.ensure_future(second.wait())
        await asyncio.sleep(0)
        first.release()
        first.release()  # idempotent
        await waiter
        assert (adm.running, adm.waiting) == (1, 0)
        second.release()
        third = adm.ticket()  # a queued request that gives up frees its place
        fourth = adm.ticket()
        fourth.abandon()
        assert (adm.running, adm.waiting) == (1, 0)
        third.release()
        assert adm.running == 0

    asyncio.run(scenario())


def test_serve_without_the_extra_names_the_install_command():
    code = ("import sys; sys.modules['fastapi'] = None\n"
            "from ortspec.runtime.cli.main import main; sys.exit(main(['serve']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "pip install 'ortspec[serve]'" in p.stderr, p.stderr


def test_a_port_in_use_is_one_line_before_the_model_loads(monkeypatch, capsys, tmp_path):
    import socket

    from helpers.export import write_graph_dir
    from ortspec.runtime import load as load_module
    from ortspec.runtime.cli.main import main

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded before the port was checked")

    monkeypatch.setattr(load_module, "load_model", no_load)
    model = ["serve", "--model", str(write_graph_dir(tmp_path / "m")), "--drafter", "none"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main([*model, "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"cannot listen on 127.0.0.1:{port}" in err, err
    assert "choose another --port" in err, err
    assert main([*model, "--host", "192.0.2.1", "--port", "0"]) == 2  # not this machine's
    err = capsys.readouterr().err
    assert "cannot listen on 192.0.2.1:0" in err and "choose another --host" in err, err


def test_ray_options_are_checked_before_anything_loads():
    from ortspec.runtime.cli.main import main

    assert main(["serve", "--replicas", "2"]) == 2  # --replicas without --ray
    assert main(["serve", "--ray", "--replicas", "0"]) == 2
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'ortspec[ray]')")
    from ortspec.runtime.errors import InvalidOptionError
    from ortspec.runtime.serve import ray_app

    with pytest.raises(InvalidOptionError, match="unknown argument.*replica\\b"):
        ray_app.build({"model": "/m", "replica": "2"})
    with pytest.raises(InvalidOptionError, match="model=DIR is required"):
        ray_app.build({"replicas": "2"})
    with pytest.raises(InvalidOptionError, match="replicas must be int, got 'two'"):
        ray_app.build({"model": "/m", "replicas": "two"})
    app = ray_app.build({"model": "/models/m", "replicas": "3", "threads": "2"})  # no Ray needed
    assert type(app).__name__ == "Application"



def test_a_batching_model_is_served_eight_at_a_time_by_default_and_any_other_four(tmp_path):
    import json as json_mod

    from helpers.export import write_graph_dir
    from ortspec.runtime.serve.cli import build_parser
    from ortspec.runtime.serve.engine import BATCHED_MAX_CONCURRENT, default_max_concurrent

    assert build_parser().parse_args([]).max_concurrent is None  # resolved from the model
    d = write_graph_dir(tmp_path / "m")
    manifest = d / "manifest.json"
    data = json_mod.loads(manifest.read_text())
    assert default_max_concurrent(d) == 4  # one request per call: each a slot of its own
    for max_batch, want in ((16, BATCHED_MAX_CONCURRENT), (2, 2)):
        manifest.write_text(json_mod.dumps({**data, "max_batch": max_batch}))
        assert default_max_concurrent(d) == want
    assert default_max_concurrent(tmp_path / "missing") == 4  # loading it will say why

# -- the server on the real model -----------------------------------------------------------------

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def model(model_dir):
    from ortspec.runtime import load_model

    return load_model(model_dir, max_concurrent=2)


@pytest.fixture(scope="module")
def server(model_dir):
    s = Server(model_dir, "--max-concurrent", "4", "--max-queue", "32")
    yield s
    s.stop()


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


NAME = "smollm2-135m-instruct-fp32"
QUESTION = "Name three colours of the rainbow."


def _generate(model, prompt, *, max_tokens=MAX_TOKENS, temperature=0.0, seed=None):
    from ortspec.runtime import SpeculativeOptions

    options = SpeculativeOptions(max_tokens, temperature=temperature, seed=seed)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):  # chat messages
        prompt = model.encode(model.manifest.chat_format.render(prompt))
    return model.generate(prompt, options=options)


@pytest.mark.slow
def test_openai_client_chat_and_completions_equal_in_process_generate(client, model):
    messages = [{"role": "user", "content": QUESTION}]
    want = _generate(model, messages)
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=MAX_TOKENS,
                                       temperature=0)
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == ("stop" if want.finish_reason == "stop" else "length")
    assert r.usage.completion_tokens == want.num_tokens
    spec = r.model_extra["speculative"]
    assert spec["drafter"] == "prompt-lookup" and spec["target_calls"] >= 1
    assert 0 <= spec["acceptance_rate"] <= 1 and spec["mean_tokens_per_target_call"] >= 1

    chunks = list(client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == want.num_tokens and not chunks[-1].choices

    # multi-turn, with a system message
    turns = [{"role": "system", "content": "You answer in one word."},
             {"role": "user", "content": "Capital of France?"},
             {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Italy?"}]
    r = client.chat.completions.create(model=NAME, messages=turns, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == _generate(model, turns).text

    prompt = "The three primary colours are"
    want = _generate(model, prompt)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == want.text and r.usage.prompt_tokens == len(model.encode(prompt))
    ids = model.encode(prompt)
    streamed = client.completions.create(model=NAME, prompt=ids, max_tokens=MAX_TOKENS,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want.text

    # a stop string that spans pieces: the text ends just before it, finish_reason "stop"
    stop = want.text[5:9]
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                  temperature=0, stop=[stop])
    assert r.choices[0].text == want.text[:want.text.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                         temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want.text[:want.text.index(stop)]

    assert [m.id for m in client.models.list().data] == [NAME]
    # created: when the server took the model, a Unix time in seconds, not 0
    assert 0 < client.models.list().data[0].created <= time.time()


@pytest.mark.slow
def test_a_stop_string_reports_the_exact_usage_and_the_speculative_section(client, model):
    prompt = "Count from one to twenty in words: one, two, three,"
    want = _generate(model, prompt, max_tokens=32)
    stop = " seven"
    assert stop in want.text, want.text
    through = want.text[:want.text.index(stop) + len(stop)]
    # the answer's tokens: those up to the one that completed the stop string
    n = next(k for k in range(len(want.tokens) + 1) if model.decode(want.tokens[:k]).startswith(through))
    assert n < len(want.tokens)
    generated_before = _metric_total(client, "vllm:generation_tokens_total")
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=32, temperature=0, stop=stop)
    assert r.choices[0].text == want.text[:want.text.index(stop)] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == n and r.usage.prompt_tokens == len(model.encode(prompt))
    spec = r.model_extra["speculative"]
    assert spec is not None and spec["drafter"] == "prompt-lookup"
    assert spec["target_calls"] >= 1 and spec["drafted_tokens"] >= spec["accepted_tokens"]
    # the last step may have emitted past the stop: decoded and counted, not answered
    assert n <= spec["emitted_tokens"] <= n + 16
    assert spec["emitted_tokens"] <= spec["accepted_tokens"] + spec["target_calls"]
    assert _metric_total(client, "vllm:generation_tokens_total") - generated_before == n

    chunks = list(client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": QUESTION}], max_tokens=MAX_TOKENS,
        temperature=0, stop=["\n", ","], stream=True, stream_options={"include_usage": True}))
    want = _generate(model, [{"role": "user", "content": QUESTION}])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    cut = min(i for i in (want.text.find("\n"), want.text.find(","), len(want.text)) if i >= 0)
    assert text == want.text[:cut]
    last = chunks[-1]
    if cut < len(want.text):  # a stop string ended it
        n = next(k for k in range(len(want.tokens) + 1)
                 if model.decode(want.tokens[:k]).startswith(want.text[:cut + 1]))
        assert last.usage.completion_tokens == n
        assert last.model_extra["speculative"]["emitted_tokens"] >= n


def _metric_total(client, name: str) -> float:
    import httpx

    text = httpx.get(str(client.base_url).removesuffix("/v1/") + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


@pytest.mark.slow
def test_malformed_requests_get_openai_errors_and_the_server_keeps_serving(server):
    import httpx

    capacity = 2048
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [  # (path, body, status, param, words in the message)
        ("/v1/chat/completions", b"{not json", 400, None, "not valid JSON"),
        ("/v1/chat/completions", {**chat, "messages": "hi"}, 400, "messages", "non-empty list"),
        ("/v1/chat/completions", {**chat, "temperature": -1}, 400, "temperature", "between 0 and 2"),
        ("/v1/chat/completions", {**chat, "temperature": 3}, 400, "temperature", "between 0 and 2"),
        ("/v1/chat/completions", {**chat, "speculative": {"drafter": "x"}}, 400, "speculative",
         "field of the response"),
        ("/v1/chat/completions", {**chat, "top_p": 2}, 400, "top_p", "(0, 1]"),
        ("/v1/chat/completions", {**chat, "n": 3}, 400, "n", "n must be 1"),
        ("/v1/chat/completions", {**chat, "model": "gpt-4"}, 404, "model", "does not exist"),
        ("/v1/completions", {"model": NAME, "prompt": [1] * (capacity + 5)}, 400, "prompt",
         f"{capacity + 5} tokens; this model's context holds at most {capacity}"),
        ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 5000}, 400,
         "max_tokens", "5000, but at most"),
        ("/v1/completions", {"model": NAME, "prompt": 7}, 400, "prompt", "got 7"),
    ]
    for path, body, status, param, words in cases:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(server.url + path, content=content, timeout=30)
        err = r.json()["error"]
        assert r.status_code == status and err["param"] == param and words in err["message"], r.text
        assert set(err) == {"message", "type", "param", "code"} and "Traceback" not in r.text
    r = httpx.get(server.url + "/v1/nothing-here", timeout=10)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 2,
                                                         "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.slow
def test_concurrent_clients_all_finish_with_the_serial_outputs(server, model):
    import openai

    prompts = ["Name a fruit.", "What is 3 + 4?", "Say hello in French.", "Name a planet."]
    # (prompt, temperature, seed, stream): greedy and seeded sampling, streamed and not
    jobs = [(p, t, s, st) for p in prompts for (t, s) in ((0.0, None), (0.8, 11), (1.0, 5))
            for st in (False, True)]  # 24 requests
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
        for i in range(k, len(jobs), 8):
            p, t, s, st = jobs[i]
            try:
                kw = dict(model=NAME, messages=[{"role": "user", "content": p}], max_tokens=8,
                          temperature=t, seed=s)
                if st:
                    results[i] = "".join(ch.choices[0].delta.content or "" for ch in
                                         c.chat.completions.create(stream=True, **kw) if ch.choices)
                else:
                    results[i] = c.chat.completions.create(**kw).choices[0].message.content
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert len(results) == len(jobs)
    serial: dict[tuple, str] = {}
    for i, (p, t, s, _) in enumerate(jobs):  # the same seed gives the same text
        if (p, t, s) not in serial:
            serial[p, t, s] = _generate(model, [{"role": "user", "content": p}], max_tokens=8,
                                        temperature=t, seed=s).text
        assert results[i] == serial[p, t, s], (jobs[i], results[i], serial[p, t, s])
    assert server.metric("vllm:num_requests_running") == 0
    assert server.metric("vllm:num_requests_waiting") == 0
    assert server.metric("vllm:spec_decode_num_draft_tokens_total") >= \
        server.metric("vllm:spec_decode_num_accepted_tokens_total") > 0
    assert server.metric("vllm:time_to_first_token_seconds_count") >= len(jobs)


@pytest.mark.slow
def test_a_client_that_disconnects_mid_stream_frees_its_slot(server):
    import httpx

    body = {"model": NAME, "prompt": "1, 2, 3, 4, 5,", "max_tokens": 1500, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [line for line, _ in zip((x for x in lines if x.startswith("data:")), range(3))]
        assert len(got) == 3
        assert server.metric("vllm:num_requests_running") == 1
    t0 = time.monotonic()
    while server.metric("vllm:num_requests_running") != 0:  # 1500 tokens would take minutes
        assert time.monotonic() - t0 < 15, "the disconnected request kept its slot"
        time.sleep(0.2)
    assert httpx.get(server.url + "/health", timeout=5).json()["status"] == "ok"


@pytest.mark.slow
def test_a_non_streaming_client_that_disconnects_is_cancelled_within_a_step(server):
    aborted = 'vllm:request_success_total{finished_reason="abort"}'
    before = server.metric(aborted, default=0.0)
    generated = server.metric("vllm:generation_tokens_total", default=0.0)
    body = json.dumps({"model": NAME, "prompt": "1, 2, 3, 4, 5,", "max_tokens": 1500,
                       "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        t0 = time.monotonic()
        while server.metric("vllm:num_requests_running") != 1:
            assert time.monotonic() - t0 < 30, "the request never started"
            time.sleep(0.05)
        time.sleep(0.5)  # decoding: 1500 tokens would take most of a minute
    t0 = time.monotonic()
    while server.metric("vllm:num_requests_running") != 0:
        assert time.monotonic() - t0 < 5, "the disconnected request kept decoding"
        time.sleep(0.05)
    assert server.metric(aborted) == before + 1
    assert 0 < server.metric("vllm:generation_tokens_total") - generated < 500
    r = __import__("httpx").post(server.url + "/v1/completions", json={
        "model": NAME, "prompt": "Hi", "max_tokens": 2, "temperature": 0}, timeout=60)
    assert r.status_code == 200


@pytest.mark.slow
def test_a_full_queue_is_503_and_sigterm_lets_the_running_stream_finish(model_dir):
    import httpx

    s = Server(model_dir, "--max-concurrent", "1", "--max-queue", "0", "--drafter", "none")
    try:
        body = {"model": NAME, "prompt": "1, 2, 3, 4, 5,", "max_tokens": 40, "temperature": 0,
                "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
            lines = (x for x in r.iter_lines() if x.startswith("data:"))
            first = next(lines)
            busy = httpx.post(s.url + "/v1/completions", json={**body, "stream": False}, timeout=10)
            assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
            assert busy.json()["error"]["code"] == "queue_full"
            s.proc.send_signal(signal.SIGTERM)
            rest = [first, *lines]
        assert rest[-1] == "data: [DONE]"
        finish = json.loads(rest[-2].removeprefix("data: "))["choices"][0]["finish_reason"]
        assert finish in ("length", "stop")
        assert s.proc.wait(30) == 0, s.output()
    finally:
        s.stop()


@pytest.mark.slow
def test_ray_serve_two_replicas_answer_through_the_openai_client(model_dir, model):
    """`ortspec serve --ray`: two replicas of one thread each behind Ray Serve's HTTP proxy, the
    same routes and answers; SIGTERM takes the application down and exits 0."""
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'ortspec[ray]')")
    import httpx
    import openai

    s = Server(model_dir, "--ray", "--replicas", "2", "--threads", "1", "--max-concurrent", "2",
               env={"RAY_USAGE_STATS_ENABLED": "0"}, ready_s=300, stop_s=120)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [NAME]
        prompts = ["Name a fruit.", "What is 3 + 4?"]
        jobs = [(p, stream) for p in prompts for stream in (False, True)]
        got: dict[int, str] = {}
        errors: list[BaseException] = []

        def ask(i: int) -> None:
            p, stream = jobs[i]
            kw = dict(model=NAME, messages=[{"role": "user", "content": p}], max_tokens=8,
                      temperature=0)
            try:
                if stream:
                    got[i] = "".join(c.choices[0].delta.content or "" for c in
                                     client.chat.completions.create(stream=True, **kw) if c.choices)
                else:
                    r = client.chat.completions.create(**kw)
                    assert r.model_extra["speculative"]["target_calls"] >= 1
                    got[i] = r.choices[0].message.content
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        for i, (p, _) in enumerate(jobs):
            assert got[i] == _generate(model, [{"role": "user", "content": p}], max_tokens=8).text
        pids = {httpx.get(s.url + "/health", timeout=10).json()["pid"] for _ in range(24)}
        assert len(pids) == 2, pids  # both replicas answer
        r = httpx.post(s.url + "/v1/completions", json={"model": NAME, "prompt": "a", "top_p": 3},
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(120) == 0, s.output()
    finally:
        s.stop()


@pytest.mark.slow
def test_ray_serve_replica_on_the_batched_export_batches_with_the_serial_texts(window_fp32):
    """`ortspec serve --ray` on the `--attention window` export: the replica's requests decode
    in shared calls (its /metrics), the prompt cache finds the system prompt, and every text is
    the one the model gives alone, a bad request among them."""
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'ortspec[ray]')")
    import openai

    from ortspec.runtime import SpeculativeOptions, load_model

    name = window_fp32.name
    solo = load_model(window_fp32, max_concurrent=1, batch=False)
    s = Server(window_fp32, "--ray", "--replicas", "1", "--threads", "2", "--max-concurrent",
               "4", env={"RAY_USAGE_STATS_ENABLED": "0"}, ready_s=300, stop_s=120)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
        prompts = ["Name a fruit.", "What is 3 + 4?", "Say hello in French.", "Name a planet."]

        def ask(i: int):
            if i == len(prompts):  # bad input among the good
                with pytest.raises(openai.BadRequestError):
                    client.chat.completions.create(
                        model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=0)
                return None
            r = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": prompts[i]}], max_tokens=12,
                temperature=0)
            return r.choices[0].message.content

        got = in_threads(ask, list(range(len(prompts) + 1)), timeout=300)
        for p, text in zip(prompts, got, strict=False):
            want = solo.generate(p, chat=True, options=SpeculativeOptions(12)).text
            assert text == want, p
        assert s.metric("ortspec:batch_rows_sum") > s.metric("ortspec:batch_rows_count") > 0
        assert s.metric("vllm:prefix_cache_hits_total") >= 20
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(120) == 0, s.output()
    finally:
        s.stop()


@pytest.mark.slow
def test_the_int4_export_serves_a_conversation_from_its_prefix_cache_with_unchanged_texts(
        int4_model_dir):
    """`ortspec serve` on the default int4 export (each request on calls of its own): chat
    requests at once, a conversation's next turn and a bad request among them, through the
    official client. Every text is the one the model gives with no prefix cache, and /metrics
    counts the system prompt and the earlier turn as found."""
    import openai

    from ortspec.runtime import SpeculativeOptions, load_model

    off = load_model(int4_model_dir, max_concurrent=1, prefix_cache_mib=0)
    s = Server(int4_model_dir, "--max-concurrent", "2", "--threads", "2")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
        name = int4_model_dir.name
        first = [{"role": "user", "content": "Name a fruit."}]
        answer = client.chat.completions.create(model=name, messages=first, max_tokens=12,
                                                temperature=0).choices[0].message.content
        conversations = [first + [{"role": "assistant", "content": answer},
                                  {"role": "user", "content": "And a vegetable?"}],
                         [{"role": "user", "content": "What is 3 + 4?"}],
                         [{"role": "user", "content": "Say hello in French."}], None]

        def ask(messages):
            if messages is None:  # bad input among the good
                with pytest.raises(openai.BadRequestError, match="max_tokens"):
                    client.chat.completions.create(
                        model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=-1)
                return None
            return client.chat.completions.create(model=name, messages=messages, max_tokens=12,
                                                  temperature=0).choices[0].message.content

        got = in_threads(ask, conversations, timeout=300)
        for messages, text in zip([first, *conversations[:3]], [answer, *got[:3]]):
            prompt = off.encode(off.manifest.chat_format.render(messages))
            assert text == off.generate(prompt, options=SpeculativeOptions(12)).text, messages
        history = off.encode(off.manifest.chat_format.render(first))
        assert s.metric("vllm:prefix_cache_hits_total") >= 20 * 2 + len(history) - 1
        assert s.metric("vllm:prefix_cache_queries_total") > s.metric("vllm:prefix_cache_hits_total")
    finally:
        s.stop()
