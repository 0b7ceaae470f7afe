"""The ReMe experience provider: an HTTP client of a ReMe task-memory service (https://github.com/agentscope-ai/ReMe),
the service AgentEvolver's Self-Navigating talks to. The service keeps the memories (per `workspace_id`), so
`add` does nothing and `records` is empty; `shared = True`: only the main process summarises into it.

It speaks two JSON endpoints, both `POST` (ReMe's flow service; ReMe 0.1.x to 0.3.x; the 0.4 rewrite has neither):

* `/summary_task_memory`: `{"workspace_id", "trajectories": [{"task_id", "messages", "score", "metadata"}]}`;
  the reply's `metadata.memory_list` lists the memories it made (`content`, `when_to_use`, ...).
* `/retrieve_task_memory`: `{"workspace_id", "query", "top_k"}`; the reply's `metadata.memory_list` lists the
  memories found, best first; their `content` is what `retrieve` returns.

The reply is untrusted: anything but a 200 carrying the expected JSON raises `ReMeError`.

Example (construction only: nothing is sent until `retrieve` or `summarize`):

```python
from trl_exreplay.guidance import ExperienceProvider
from trl_exreplay.guidance.reme import ReMeExperienceProvider

provider = ReMeExperienceProvider("http://127.0.0.1:8001", workspace_id="alfworld", timeout=10.0)
assert isinstance(provider, ExperienceProvider) and provider.shared
assert provider.records() == []
# provider.summarize([...]) posts to http://127.0.0.1:8001/summary_task_memory,
# provider.retrieve("put a mug in the sink", k=3) to http://127.0.0.1:8001/retrieve_task_memory.
```
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.parse
from typing import Any

from .provider import ExperienceRecord, PartialSummaryError, SummaryInput

__all__ = ["RETRIEVE_ENDPOINT", "SUMMARY_ENDPOINT", "ReMeError", "ReMeExperienceProvider", "trajectory_payload"]

SUMMARY_ENDPOINT = "/summary_task_memory"
RETRIEVE_ENDPOINT = "/retrieve_task_memory"
MAX_REPLY_BYTES = 32 * 1024 * 1024  # a reply larger than this is refused, not read
MAX_TIMEOUT = 86_400.0  # seconds: a day; a socket refuses far larger timeouts (OverflowError), and none is meant


class ReMeError(RuntimeError):
    """The ReMe service could not be reached, or its reply was not what the endpoint promises."""


def trajectory_payload(trajectory: SummaryInput) -> dict:
    """A `SummaryInput` as ReMe's trajectory: the task as the first user message, then the model's actions as
    assistant messages, each followed by the environment's observation (a user message) when there is one;
    `score` is the reward; `metadata.query` is the task text (ReMe's extraction prompts read it)."""
    messages = [{"role": "user", "content": trajectory.query}]
    for i, action in enumerate(trajectory.actions):
        messages.append({"role": "assistant", "content": action})
        if i < len(trajectory.observations):
            messages.append({"role": "user", "content": trajectory.observations[i]})
    for observation in trajectory.observations[len(trajectory.actions) :]:
        messages.append({"role": "user", "content": observation})
    return {
        "task_id": trajectory.task_id,
        "messages": messages,
        "score": float(trajectory.reward),
        "metadata": {"query": trajectory.query},
    }


def _validate_base_url(base_url: Any) -> str:
    if not isinstance(base_url, str):
        raise ValueError(f"base_url must be a string like 'http://127.0.0.1:8001', got {base_url!r}")
    parts = urllib.parse.urlsplit(base_url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"base_url must be an http:// or https:// URL with a host, like 'http://127.0.0.1:8001'; got {base_url!r}"
        )
    if parts.query or parts.fragment:
        raise ValueError(f"base_url must not have a query or a fragment; got {base_url!r}")
    try:
        _ = parts.port  # raises on a port that is not a number in range
    except ValueError as error:
        raise ValueError(f"base_url has an invalid port: {base_url!r}") from error
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))


class ReMeExperienceProvider:
    """An `ExperienceProvider` backed by a ReMe task-memory service at `base_url`, in workspace `workspace_id`.

    Speaks `POST /summary_task_memory` and `POST /retrieve_task_memory` (JSON, the shapes in the module docstring).
    Tested against a loopback server that speaks them (`tests/unit/test_guidance_reme.py`); the wire format was also
    checked by hand against a real ReMe 0.2.0.6 server whose LLM and embedding API were loopback stand-ins.

    * `retrieve(task, k)`: the `content` of at most `k` memories for the task text, best first (empty contents
      dropped). `k <= 0` sends nothing.
    * `summarize(trajectories)`: one request per task (the trajectories grouped by `task_id`, in first-seen order, so
      ReMe can compare attempts at one task); one `ExperienceRecord` per memory the service reports made: its
      `task_id` is the group's, its `query` the memory's `when_to_use` (what ReMe retrieves by; the task text when
      that is empty), its `source` the trajectory's when the group had one trajectory (else ""), its `step` the
      group's latest. ReMe stores the memories itself. A reply without `metadata.memory_list` is accepted as "none
      made" only when `metadata.update_result.inserted_count` is 0 (what ReMe 0.2 replies then).
    * `add` does nothing; `records` returns [].

    Every failure raises `ReMeError` (a `RuntimeError`): no connection, no complete answer within `timeout` seconds
    (one deadline for the whole request, however slowly the server drips its reply), a status other than 200
    (redirects are not followed; no proxy is used: the service is reached directly), a body that is not JSON, or a
    missing or wrong-typed field; the message names the endpoint and the field. ReMe replies 200 with
    `success: false` when a flow fails: that raises too. (ReMe 0.2 also swallows some failures inside a summary flow
    and replies as if nothing was made; a client cannot tell those apart.)
    """

    shared = True

    def __init__(self, base_url: str, workspace_id: str = "default", timeout: float = 30.0):
        self.base_url = _validate_base_url(base_url)
        if not isinstance(workspace_id, str) or not workspace_id.strip():
            raise ValueError(f"workspace_id must be a non-empty string, got {workspace_id!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (0 < timeout <= MAX_TIMEOUT):
            raise ValueError(f"timeout must be a number of seconds in (0, {MAX_TIMEOUT:g}], got {timeout!r}")
        self.workspace_id = workspace_id
        self.timeout = float(timeout)

    def __repr__(self) -> str:
        return f"ReMeExperienceProvider({self.base_url!r}, workspace_id={self.workspace_id!r})"

    # ----- the protocol -------------------------------------------------------------------------------------------

    def retrieve(self, task: str, k: int) -> list[str]:
        if isinstance(k, bool) or not isinstance(k, int):
            raise TypeError(f"k must be an int, got {k!r}")
        if k <= 0:
            return []
        reply = self._post(RETRIEVE_ENDPOINT, {"workspace_id": self.workspace_id, "query": task, "top_k": k})
        memories = self._memory_list(RETRIEVE_ENDPOINT, reply, required=True)
        contents = [memory["content"] for memory in memories if memory["content"].strip()]
        return contents[:k]

    def summarize(self, trajectories: list[SummaryInput]) -> list[ExperienceRecord]:
        groups: dict[str, list[SummaryInput]] = {}
        for trajectory in trajectories:
            groups.setdefault(trajectory.task_id, []).append(trajectory)
        records, failed, error = [], [], None
        for task_id, group in groups.items():
            payload = {"workspace_id": self.workspace_id, "trajectories": [trajectory_payload(t) for t in group]}
            try:
                memories = self._memory_list(SUMMARY_ENDPOINT, self._post(SUMMARY_ENDPOINT, payload), required=False)
            except ReMeError as e:  # this task's request failed; the others' memories are stored by now
                failed += group
                error = e
                continue
            source = group[0].source if len(group) == 1 else ""
            step = max(t.step for t in group)
            for memory in memories:
                if not memory["content"].strip():
                    continue
                query = memory.get("when_to_use") or group[0].query
                records.append(ExperienceRecord(task_id, query, memory["content"], source, step))
        if failed and len(failed) == len(trajectories):
            raise error
        if failed:  # offer again only what the service did not take, or it would store the rest twice
            raise PartialSummaryError(records, failed, error)
        return records

    def add(self, records: list[ExperienceRecord]) -> None:
        """Nothing to do: the service stored the memories when it made them."""

    def records(self) -> list[ExperienceRecord]:
        return []

    # ----- the wire -----------------------------------------------------------------------------------------------

    def _post(self, endpoint: str, payload: dict) -> dict:
        url = self.base_url + endpoint
        body, status, detail = self._exchange(endpoint, url, json.dumps(payload, ensure_ascii=False).encode("utf-8"))
        if status != 200:
            raise ReMeError(f"ReMe {endpoint}: HTTP status {status}, expected 200: {detail!r}")
        if len(body) > MAX_REPLY_BYTES:
            raise ReMeError(f"ReMe {endpoint}: reply larger than {MAX_REPLY_BYTES} bytes, refused")
        try:
            reply = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ReMeError(f"ReMe {endpoint}: reply body is not JSON ({error}): {body[:200]!r}") from error
        except RecursionError:  # valid JSON nested deeper than Python's parser goes: no reply ReMe makes
            raise ReMeError(f"ReMe {endpoint}: reply body is JSON nested too deeply to read: {body[:200]!r}") from None
        if not isinstance(reply, dict):
            raise ReMeError(f"ReMe {endpoint}: reply: expected a JSON object, got {type(reply).__name__}")
        success = reply.get("success")
        if not isinstance(success, bool):
            raise ReMeError(f"ReMe {endpoint}: field 'success': expected a boolean, got {success!r}")
        if not success:
            answer = reply.get("answer")
            raise ReMeError(f"ReMe {endpoint}: field 'success' is false (the flow failed): {str(answer)[:500]!r}")
        return reply

    def _exchange(self, endpoint: str, url: str, data: bytes) -> tuple[bytes, int, str]:
        """POST `data` to `url`: (body, status, the start of a non-200 body). The whole exchange (connect, send, the
        status line, headers and body) must end within `timeout` seconds: a socket's own timeout bounds each read
        only, so a server that drips one byte at a time would hold it for ever. A timer shuts the socket down at the
        deadline, which wakes the blocked read."""
        parts = urllib.parse.urlsplit(url)
        connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection = connection_class(parts.hostname, parts.port, timeout=self.timeout)
        deadline = time.monotonic() + self.timeout
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            if connection.sock is not None:
                try:  # the plain socket's shutdown: an SSL socket's would also drop its SSL state under the reader
                    socket.socket.shutdown(connection.sock, socket.SHUT_RDWR)
                except OSError:
                    pass

        timer = None
        late = ReMeError(f"ReMe {endpoint}: no complete answer from {url} within {self.timeout:g} s")
        try:
            connection.connect()  # bounded by the socket timeout, itself `timeout`
            timer = threading.Timer(max(deadline - time.monotonic(), 0.0), expire)
            timer.daemon = True
            timer.start()
            headers = {"Content-Type": "application/json", "Accept": "application/json"}
            connection.request("POST", parts.path or "/", body=data, headers=headers)
            response = connection.getresponse()
            status = response.status
            body = response.read(MAX_REPLY_BYTES + 1 if status == 200 else 500)
        except TimeoutError as error:
            raise late from error
        except (OSError, ValueError, http.client.HTTPException) as error:  # refused, reset, a bad status line...
            if expired.is_set():
                raise late from error
            if isinstance(error, ConnectionRefusedError) or connection.sock is None:
                raise ReMeError(f"ReMe {endpoint}: cannot reach {url}: {error!r}") from error
            raise ReMeError(f"ReMe {endpoint}: request to {url} failed: {error!r}") from error
        finally:
            if timer is not None:
                timer.cancel()
            connection.close()
        if expired.is_set():  # the shutdown may have ended the body early, looking like a short reply
            raise late
        return body, status, "" if status == 200 else body.decode("utf-8", "replace")

    @staticmethod
    def _memory_list(endpoint: str, reply: dict, required: bool) -> list[dict]:
        """`reply.metadata.memory_list`, each entry checked: an object whose `content` is a string and whose
        `when_to_use`, when present, is a string."""
        metadata = reply.get("metadata")
        if not isinstance(metadata, dict):
            raise ReMeError(f"ReMe {endpoint}: field 'metadata': expected an object, got {metadata!r}")
        if "memory_list" not in metadata:
            update = metadata.get("update_result")
            nothing_made = isinstance(update, dict) and update.get("inserted_count") == 0
            if required or not nothing_made:
                raise ReMeError(
                    f"ReMe {endpoint}: field 'metadata.memory_list' is missing"
                    + ("" if required else " (and 'metadata.update_result.inserted_count' is not 0)")
                )
            return []
        memories = metadata["memory_list"]
        if not isinstance(memories, list):
            raise ReMeError(
                f"ReMe {endpoint}: field 'metadata.memory_list': expected a list, got {type(memories).__name__}"
            )
        for i, memory in enumerate(memories):
            field = f"metadata.memory_list[{i}]"
            if not isinstance(memory, dict):
                raise ReMeError(f"ReMe {endpoint}: field '{field}': expected an object, got {type(memory).__name__}")
            if "content" not in memory:
                raise ReMeError(f"ReMe {endpoint}: field '{field}.content' is missing")
            if not isinstance(memory["content"], str):
                raise ReMeError(
                    f"ReMe {endpoint}: field '{field}.content': expected a string, "
                    f"got {type(memory['content']).__name__}"
                )
            if not isinstance(memory.get("when_to_use", ""), str):
                raise ReMeError(
                    f"ReMe {endpoint}: field '{field}.when_to_use': expected a string, "
                    f"got {type(memory['when_to_use']).__name__}"
                )
        return memories
