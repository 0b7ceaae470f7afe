"""`ReMeExperienceProvider` against a loopback server that speaks ReMe's task-memory endpoints with ReMe's JSON shapes
(`POST /summary_task_memory`, `POST /retrieve_task_memory`; reply `{"answer", "success", "metadata": {"memory_list":
[...]}}`), keeps memories per workspace and retrieves those whose `when_to_use` shares words with the query, best
first. Also: what the client sends, and that every malformed reply raises `ReMeError`."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trl_exreplay.guidance import ExperienceProvider, ExperienceRecord, SummaryInput
from trl_exreplay.guidance.reme import RETRIEVE_ENDPOINT, SUMMARY_ENDPOINT, ReMeError, ReMeExperienceProvider


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


class FakeReMe(ThreadingHTTPServer):
    """ReMe's two task-memory endpoints. A summarised trajectory makes one memory: `when_to_use` is its task text
    (`metadata.query`), `content` "Do: " and its assistant messages joined by "; "."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.memories: dict[str, list[dict]] = {}
        self.requests: list[tuple[str, dict, dict]] = []  # (path, headers, body)
        self.override: dict[str, tuple[int, bytes]] = {}  # path -> (status, raw body): a broken server
        self.sleep = 0.0
        self.fail_task: str | None = None  # a summary request for this task id gets `failure` (a 500)
        self.failure: tuple[int, bytes] = (500, b'{"detail": "model down"}')
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def summary(self, body: dict) -> dict:
        made = []
        for trajectory in body["trajectories"]:
            actions = [m["content"] for m in trajectory["messages"] if m["role"] == "assistant"]
            made.append(
                {
                    "workspace_id": body["workspace_id"],
                    "memory_id": uuid.uuid4().hex,
                    "memory_type": "task",
                    "when_to_use": trajectory["metadata"]["query"],
                    "content": "Do: " + "; ".join(actions),
                    "score": 0.9,
                    "time_created": "2026-01-01 00:00:00",
                    "time_modified": "2026-01-01 00:00:00",
                    "author": "fake",
                    "metadata": {},
                }
            )
        self.memories.setdefault(body["workspace_id"], []).extend(made)
        return {
            "answer": json.dumps(made),
            "success": True,
            "metadata": {"memory_list": made, "update_result": {"deleted_count": 0, "inserted_count": len(made)}},
        }

    def retrieve(self, body: dict) -> dict:
        query = _words(body["query"])
        scored = []
        for i, memory in enumerate(self.memories.get(body["workspace_id"], [])):
            shared = len(query & _words(memory["when_to_use"]))
            if shared:
                scored.append((-shared, i, {**memory, "score": shared / max(len(query), 1)}))
        found = [memory for _, _, memory in sorted(scored, key=lambda x: x[:2])][: body["top_k"]]
        answer = "".join(
            f"Memory {i} :\n When to use: {m['when_to_use']}\n Content: {m['content']}\n"
            for i, m in enumerate(found, 1)
        )
        return {"answer": answer, "success": True, "metadata": {"memory_list": found}}


class _Handler(BaseHTTPRequestHandler):
    server: FakeReMe

    def log_message(self, *args):
        pass

    def do_POST(self):
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        server = self.server
        if server.sleep:
            time.sleep(server.sleep)
        body = json.loads(raw)
        with server.lock:
            server.requests.append((self.path, dict(self.headers), body))
            failing = self.path == SUMMARY_ENDPOINT and any(
                t.get("task_id") == server.fail_task for t in body.get("trajectories", [])
            )
            if self.path in server.override:
                status, data = server.override[self.path]
            elif failing:
                status, data = server.failure
            elif self.path == SUMMARY_ENDPOINT:
                status, data = 200, json.dumps(server.summary(body)).encode()
            elif self.path == RETRIEVE_ENDPOINT:
                status, data = 200, json.dumps(server.retrieve(body)).encode()
            else:
                status, data = 404, b'{"detail": "Not Found"}'
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server():
    fake = FakeReMe()
    thread = threading.Thread(target=fake.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield fake
    fake.shutdown()
    fake.server_close()


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


MUG = SummaryInput(
    "t1:aa", "t1", "put a clean mug in the sink", ["go to sink 1", "put mug 1 in sink 1"], 1.0, 3, ["You arrive."]
)
LAMP = SummaryInput("t2:bb", "t2", "look at the book under the desk lamp", ["use desklamp 1"], 1.0, 4)
PAN = SummaryInput("t3:cc", "t3", "put a hot pan on the table", ["take pan 1", "heat pan 1"], 0.5, 5, ["Taken."])


# The round trip


def test_summarise_then_retrieve_round_trip(server):
    provider = ReMeExperienceProvider(server.url, workspace_id="w")
    records = provider.summarize([MUG, LAMP, PAN])
    assert records == [
        ExperienceRecord("t1", "put a clean mug in the sink", "Do: go to sink 1; put mug 1 in sink 1", "t1:aa", 3),
        ExperienceRecord("t2", "look at the book under the desk lamp", "Do: use desklamp 1", "t2:bb", 4),
        ExperienceRecord("t3", "put a hot pan on the table", "Do: take pan 1; heat pan 1", "t3:cc", 5),
    ]
    # "put a clean pan in the sink": the mug memory shares put/a/clean/in/the/sink (6), the pan one put/a/pan/the (4)
    assert provider.retrieve("put a clean pan in the sink", 5) == [
        "Do: go to sink 1; put mug 1 in sink 1",
        "Do: take pan 1; heat pan 1",
        "Do: use desklamp 1",
    ]
    assert provider.retrieve("xyzzy", 5) == []
    provider.add(records)  # the service stores them: nothing changes
    assert provider.records() == []
    assert len(server.memories["w"]) == 3


def test_workspaces_are_isolated(server):
    a = ReMeExperienceProvider(server.url, workspace_id="a")
    b = ReMeExperienceProvider(server.url, workspace_id="b")
    a.summarize([MUG])
    b.summarize([LAMP])
    assert a.retrieve("put a mug in the sink under the lamp", 5) == ["Do: go to sink 1; put mug 1 in sink 1"]
    assert b.retrieve("put a mug in the sink under the lamp", 5) == ["Do: use desklamp 1"]
    assert ReMeExperienceProvider(server.url, workspace_id="c").retrieve("put a mug in the sink", 5) == []


def test_top_k_is_sent_and_at_most_k_are_returned(server):
    provider = ReMeExperienceProvider(server.url)
    provider.summarize([MUG, LAMP, PAN])
    assert provider.retrieve("put a clean pan in the sink", 1) == ["Do: go to sink 1; put mug 1 in sink 1"]
    assert provider.retrieve("put a clean pan in the sink", 2) == [
        "Do: go to sink 1; put mug 1 in sink 1",
        "Do: take pan 1; heat pan 1",
    ]
    assert [body["top_k"] for _, _, body in server.requests[-2:]] == [1, 2]
    n = len(server.requests)
    assert provider.retrieve("put a mug", 0) == []  # nothing asked: nothing sent
    assert len(server.requests) == n
    # A server that ignores top_k: still at most k
    many = [{"content": f"c{i}", "when_to_use": "w"} for i in range(5)]
    reply = {"answer": "", "success": True, "metadata": {"memory_list": many}}
    server.override[RETRIEVE_ENDPOINT] = (200, json.dumps(reply).encode())
    assert provider.retrieve("anything", 2) == ["c0", "c1"]


def test_empty_contents_are_dropped(server):
    memories = [{"content": ""}, {"content": "  \n"}, {"content": "keep me", "when_to_use": ""}]
    reply = {"answer": "", "success": True, "metadata": {"memory_list": memories}}
    server.override[RETRIEVE_ENDPOINT] = (200, json.dumps(reply).encode())
    server.override[SUMMARY_ENDPOINT] = (200, json.dumps(reply).encode())
    provider = ReMeExperienceProvider(server.url)
    assert provider.retrieve("anything", 3) == ["keep me"]
    # an empty when_to_use: the record's query is the task text
    assert provider.summarize([MUG]) == [ExperienceRecord("t1", MUG.query, "keep me", "t1:aa", 3)]


# What is sent


def test_request_bodies_have_exactly_remes_fields(server):
    provider = ReMeExperienceProvider(server.url + "/", workspace_id="ws-1")
    provider.summarize([MUG, PAN])
    provider.retrieve("put a mug in the sink", 3)
    (p1, h1, s1), (p2, _, s2), (p3, h3, r) = server.requests
    assert (p1, p2, p3) == (SUMMARY_ENDPOINT, SUMMARY_ENDPOINT, RETRIEVE_ENDPOINT)
    assert h1["Content-Type"] == h3["Content-Type"] == "application/json"
    assert s1 == {
        "workspace_id": "ws-1",
        "trajectories": [
            {
                "task_id": "t1",
                "messages": [
                    {"role": "user", "content": "put a clean mug in the sink"},
                    {"role": "assistant", "content": "go to sink 1"},
                    {"role": "user", "content": "You arrive."},
                    {"role": "assistant", "content": "put mug 1 in sink 1"},
                ],
                "score": 1.0,
                "metadata": {"query": "put a clean mug in the sink"},
            }
        ],
    }
    assert s2["trajectories"][0]["score"] == 0.5
    assert [m["role"] for m in s2["trajectories"][0]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert r == {"workspace_id": "ws-1", "query": "put a mug in the sink", "top_k": 3}


def test_trajectories_of_one_task_go_in_one_request(server):
    again = SummaryInput("t1:dd", "t1", MUG.query, ["go to sink 2"], 1.0, 7, ["Nothing.", "Trailing."])
    records = ReMeExperienceProvider(server.url).summarize([MUG, LAMP, again])
    assert [len(body["trajectories"]) for _, _, body in server.requests] == [2, 1]
    # the trailing observation after the last action is kept
    assert [m["content"] for m in server.requests[0][2]["trajectories"][1]["messages"]] == [
        MUG.query,
        "go to sink 2",
        "Nothing.",
        "Trailing.",
    ]
    # two trajectories made the t1 records: no single source; the group's latest step
    assert [(r.task_id, r.source, r.step) for r in records] == [("t1", "", 7), ("t1", "", 7), ("t2", "t2:bb", 4)]
    assert ReMeExperienceProvider(server.url).summarize([]) == []


# Untrusted replies


def _reply(memory_list=None, **top) -> bytes:
    body = {"answer": "", "success": True, "metadata": {"memory_list": memory_list or []}}
    body.update(top)
    return json.dumps(body).encode()


@pytest.mark.parametrize("endpoint", [RETRIEVE_ENDPOINT, SUMMARY_ENDPOINT])
@pytest.mark.parametrize(
    ("status", "body", "match"),
    [
        (500, b"Internal Server Error", "HTTP status 500, expected 200"),
        (422, b'{"detail": [{"loc": ["body", "query"]}]}', "HTTP status 422"),
        (302, b"", "HTTP status 302"),
        (201, _reply(), "HTTP status 201, expected 200"),
        (200, b"{not json", "reply body is not JSON"),
        (200, b"[1, 2]", "reply: expected a JSON object, got list"),
        (200, b'{"answer": "", "metadata": {"memory_list": []}}', "field 'success': expected a boolean"),
        (200, _reply(success="yes"), "field 'success': expected a boolean, got 'yes'"),
        (200, _reply(success=False, answer="('boom',)"), "field 'success' is false .*boom"),
        (200, _reply(metadata=[]), "field 'metadata': expected an object"),
        (200, _reply(metadata={"memory_list": {"content": "x"}}), "field 'metadata.memory_list': expected a list"),
        (200, _reply(["x"]), r"field 'metadata.memory_list\[0\]': expected an object, got str"),
        (200, _reply([{"content": "ok"}, {"when_to_use": "w"}]), r"'metadata.memory_list\[1\].content' is missing"),
        (200, _reply([{"content": 3}]), r"'metadata.memory_list\[0\].content': expected a string, got int"),
        (200, _reply([{"content": ["a"]}]), r"'metadata.memory_list\[0\].content': expected a string, got list"),
        (200, _reply([{"content": "a", "when_to_use": 1}]), r"\[0\].when_to_use': expected a string, got int"),
        (200, _reply(metadata={}), "field 'metadata.memory_list' is missing"),
        (200, b'{"answer": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    ],
)
def test_a_malformed_reply_raises_naming_endpoint_and_field(server, endpoint, status, body, match):
    server.override[endpoint] = (status, body)
    provider = ReMeExperienceProvider(server.url)
    with pytest.raises(ReMeError, match=f"^ReMe {endpoint}: .*{match}"):
        if endpoint == RETRIEVE_ENDPOINT:
            provider.retrieve("put a mug", 3)
        else:
            provider.summarize([MUG])


def test_a_summary_that_made_nothing_may_omit_the_memory_list(server):
    # What ReMe 0.2 replies when no memory was extracted: no memory_list, update_result says none inserted
    nothing = {"answer": "", "success": True, "metadata": {"update_result": {"deleted_count": 0, "inserted_count": 0}}}
    server.override[SUMMARY_ENDPOINT] = (200, json.dumps(nothing).encode())
    provider = ReMeExperienceProvider(server.url)
    assert provider.summarize([MUG]) == []
    nothing["metadata"]["update_result"]["inserted_count"] = 2  # inserted some, but does not say which
    server.override[SUMMARY_ENDPOINT] = (200, json.dumps(nothing).encode())
    with pytest.raises(ReMeError, match="summary_task_memory: field 'metadata.memory_list' is missing"):
        provider.summarize([MUG])
    # a retrieval without a memory_list is a failure (ReMe 0.2 replies so when its embedding API is unreachable)
    server.override[RETRIEVE_ENDPOINT] = (200, json.dumps(nothing).encode())
    with pytest.raises(ReMeError, match="retrieve_task_memory: field 'metadata.memory_list' is missing"):
        provider.retrieve("put a mug", 2)


def test_a_server_that_does_not_answer_in_time_raises(server):
    server.sleep = 2.0
    provider = ReMeExperienceProvider(server.url, timeout=0.5)
    start = time.monotonic()
    with pytest.raises(ReMeError, match=r"^ReMe /retrieve_task_memory: no complete answer from .* within 0.5 s"):
        provider.retrieve("put a mug", 3)
    assert time.monotonic() - start < 1.8


def test_no_server_raises():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(ReMeError, match="^ReMe /summary_task_memory: cannot reach"):
        ReMeExperienceProvider(f"http://127.0.0.1:{port}", timeout=2).summarize([MUG])


# Construction


@pytest.mark.parametrize(
    "url",
    ["ftp://127.0.0.1:8001", "127.0.0.1:8001", "localhost:8001", "http://", "", "file:///tmp/x",
     "http://h:99999", "http://h:8001/?q=1", 8001, None],
)  # fmt: skip
def test_bad_base_url_is_refused(url):
    with pytest.raises(ValueError, match="base_url"):
        ReMeExperienceProvider(url)


def test_construction():
    provider = ReMeExperienceProvider("https://reme.example:8443/api/")
    assert provider.base_url == "https://reme.example:8443/api"
    assert provider.workspace_id == "default" and provider.timeout == 30.0
    assert isinstance(provider, ExperienceProvider) and provider.shared is True
    for bad in (0, -1, float("inf"), float("nan"), True, "5", 1e10, 86_400.5):
        with pytest.raises(ValueError, match=r"timeout must be a number of seconds in \(0, 86400\]"):
            ReMeExperienceProvider("http://127.0.0.1:8001", timeout=bad)
    for bad in ("", "  ", None):
        with pytest.raises(ValueError, match="workspace_id"):
            ReMeExperienceProvider("http://127.0.0.1:8001", workspace_id=bad)
    with pytest.raises(TypeError, match="k must be an int"):
        provider.retrieve("x", 2.0)


def test_a_summary_that_fails_for_one_task_keeps_the_others_and_offers_only_it_again(server):
    """One request per task: the service stored the tasks that succeeded, so only the failed task's trajectories may
    be offered again (re-posting all would store the others twice)."""
    from trl_exreplay.guidance import PartialSummaryError
    from trl_exreplay.guidance.summarizer import BackgroundSummarizer

    server.fail_task = "t2"
    provider = ReMeExperienceProvider(server.url, workspace_id="w")
    with pytest.raises(PartialSummaryError) as caught:
        provider.summarize([MUG, LAMP, PAN])
    assert [r.task_id for r in caught.value.records] == ["t1", "t3"] and caught.value.failed == [LAMP]
    provider = ReMeExperienceProvider(server.url, workspace_id="w2")  # a workspace the call above did not write
    summarizer = BackgroundSummarizer(provider)
    summarizer.offer([MUG, LAMP, PAN])
    summarizer.submit()
    summarizer.wait(10)
    assert [r.task_id for r in summarizer.collect()] == ["t1", "t3"]
    assert summarizer.pending() == [LAMP] and summarizer.failures == 1 and summarizer.summarized == 2
    server.fail_task = None
    summarizer.submit()
    summarizer.wait(10)
    assert [r.task_id for r in summarizer.collect()] == ["t2"] and summarizer.pending() == []
    assert sorted(m["when_to_use"] for m in server.memories["w2"]) == sorted(x.query for x in (MUG, LAMP, PAN))
    summarizer.close()
    with pytest.raises(ReMeError, match="HTTP status 500"):  # every task failed: the service's own error
        server.fail_task = "t2"
        provider.summarize([LAMP])


def test_a_reply_nested_too_deeply_for_one_task_keeps_the_other_tasks_memories(server):
    """Valid JSON nested 100,000 deep (a RecursionError in Python's parser) answering the second task's summary is that
    task's ReMeError: the first task's stored memories are kept and only the second is offered again."""
    from trl_exreplay.guidance import PartialSummaryError

    server.fail_task = "t2"
    server.failure = (200, b'{"answer": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    provider = ReMeExperienceProvider(server.url, workspace_id="deep")
    with pytest.raises(PartialSummaryError) as caught:
        provider.summarize([MUG, LAMP])
    assert [r.task_id for r in caught.value.records] == ["t1"] and caught.value.failed == [LAMP]
    assert "nested too deeply" in str(caught.value.cause)


def dripping_server(reply: bytes):
    """A raw socket server that reads a request, then sends `reply` one byte every 0.05 s: a slow or hostile service
    whose every single read arrives well within any per-read timeout (the guidance probe's server)."""
    from helpers import load_script

    return load_script("benchmarks/guidance_probe.py", "guidance_probe").RawServer(reply, interval=0.05)


_BODY = json.dumps({"answer": "", "success": True, "metadata": {"memory_list": [{"content": "x" * 400}]}}).encode()


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\n" + b"X-Slow: " + b"a" * 200 + b"\r\n\r\n",  # dripped headers
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(_BODY) + _BODY,  # prompt headers, dripped body
        b'HTTP/1.1 500 Oops\r\nContent-Length: 400\r\n\r\n{"detail": "' + b"e" * 380 + b'"}',  # dripped error body
    ],
    ids=["headers", "body", "error-body"],
)
def test_a_dripping_server_costs_one_timeout_in_all(reply):
    """Each byte arrives within 0.05 s, so a per-read timeout never fires; the request must still end at its one
    deadline (0.5 s), not after the ~10-25 s the whole reply takes."""
    server = dripping_server(reply)
    try:
        provider = ReMeExperienceProvider(server.url, timeout=0.5)
        start = time.monotonic()
        with pytest.raises(ReMeError, match=r"^ReMe /retrieve_task_memory: no complete answer from .* within 0.5 s"):
            provider.retrieve("put a mug", 3)
        assert time.monotonic() - start < 1.5
        start = time.monotonic()
        with pytest.raises(ReMeError, match=r"^ReMe /summary_task_memory: no complete answer"):
            provider.summarize([MUG])
        assert time.monotonic() - start < 1.5
    finally:
        server.close()
