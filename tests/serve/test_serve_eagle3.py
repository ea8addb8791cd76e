"""`ortspec serve --drafter eagle3` on a batched (`--attention window`) export with an EAGLE-3
head: concurrent clients of the official `openai` package share the batch runner's calls, each
request drafting with a head of its own, and every answer equals the model's serial answer; a
malformed request in between gets an OpenAI error and the server keeps serving."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")

from helpers.serve import Server  # noqa: E402
from helpers.threads import in_threads  # noqa: E402

pytestmark = pytest.mark.slow  # builds and exports a torch checkpoint, starts a server

PROMPTS = ["The quick brown fox", "Speculative decoding drafts", "Hello, world! What is",
           "Paris is the capital"]


@pytest.fixture(scope="module")
def window_with_head(tmp_path_factory):
    from ortspec.export import export_model
    from helpers.eagle3 import tiny_llama_and_head

    root = tmp_path_factory.mktemp("eagle3-serve")
    src, head = tiny_llama_and_head(root)
    return export_model(src, out=root / "tiny-window", capacity=256, max_verify_len=8,
                        attention="window", progress=False, draft_head=head)


def test_concurrent_openai_clients_get_the_serial_answers_with_eagle3(window_with_head):
    import openai

    from ortspec.runtime import SpeculativeOptions, load_model

    # (prompt, temperature, seed): greedy and seeded sampling, 12 requests from 4 clients
    jobs = [(p, t, s) for p in PROMPTS for (t, s) in ((0.0, None), (1.0, 7), (0.7, 3))]
    solo = load_model(window_with_head, max_concurrent=1, batch=False, threads=2)
    serial = [solo.generate(p, drafter="eagle3", options=SpeculativeOptions(
        12, temperature=t, seed=s, top_k=40)).text for p, t, s in jobs]
    plain = [solo.generate(p, drafter=None, options=SpeculativeOptions(12, temperature=0.0)).text
             for p in PROMPTS]
    assert [serial[i] for i, (_, t, _) in enumerate(jobs) if t == 0.0] == plain
    server = Server(window_with_head, "--drafter", "eagle3", "--max-concurrent", "4",
                    "--threads", "2")
    try:
        def client_run(k: int) -> list[str]:  # client k asks jobs k, k + 4, k + 8
            c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                              timeout=120)
            texts = []
            for p, t, s in jobs[k::4]:
                texts.append(c.completions.create(
                    model=window_with_head.name, prompt=p, max_tokens=12, temperature=t,
                    seed=s, extra_body={"top_k": 40}).choices[0].text)
                with pytest.raises(openai.BadRequestError, match="temperature"):
                    c.completions.create(model=window_with_head.name, prompt=p, max_tokens=4,
                                         temperature=-1)
            return texts

        by_client = in_threads(client_run, [0, 1, 2, 3], timeout=300)
        assert [by_client[i % 4][i // 4] for i in range(len(jobs))] == serial
        assert server.metric("vllm:spec_decode_num_draft_tokens_total") > 0
        assert server.metric("vllm:num_requests_running") == 0
    finally:
        server.stop()
