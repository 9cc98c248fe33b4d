"""The remote backend against a local stub of the SandboxFusion API on 127.0.0.1: what it sends,
how each answer reads, and every way the service can fail."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from posttrain.rollout.environments.protocol import ModelTurn
from posttrain.rollout.environments.python_sandbox import (
    PythonSandboxConfig,
    python_sandbox_environment,
)
from posttrain.sandbox.remote import RemoteSandboxError, run_remote
from posttrain.sandbox.result import SandboxLimits

MAX_REQUEST = 2**20


def run_result(status="Finished", code=0, stdout="", stderr=""):
    return {"status": status, "execution_time": 0.01, "return_code": code, "stdout": stdout,
            "stderr": stderr}  # fmt: skip


def answer(api_status, **run):
    return 200, {"status": api_status, "run_result": run_result(**run)}


# What the stub answers to a program, by its code.
ANSWERS = {
    "print(7)": answer("Success", stdout="7\n"),
    # 3+4 with echo_last_expression: the service gets the rewritten program.
    "__import__('sys').displayhook((3+4))": answer("Success", stdout="7\n"),
    "1/0": answer("Failed", code=1, stderr="ZeroDivisionError"),
    "while True: pass": answer("Failed", status="TimeLimitExceeded", code=None),
    "print('x' * 10**4)": answer("Success", stdout="x" * 10**4),
    "broken": (200, {"status": "SandboxError", "message": "no runner for python"}),
    "http error": (500, {"detail": "internal"}),
    "not json": (200, None),
}  # fmt: skip


class Stub(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self):
        length = int(self.headers.get("Content-Length", 0))
        if self.path != "/run_code" or length > MAX_REQUEST:
            self.send_error(404 if self.path != "/run_code" else 413)
            return
        payload = json.loads(self.rfile.read(length))
        self.received.append(payload)
        status, answer = ANSWERS[payload["code"]]
        body = b"<html>" if answer is None else json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # keep the test output clean
        pass


@pytest.fixture(scope="module")
def service():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


LIMITS = SandboxLimits(timeout_s=3, memory_mb=256, max_output_bytes=100)


def test_the_request_follows_the_api(service):
    Stub.received.clear()
    result = run_remote("print(7)", LIMITS, service)
    assert Stub.received == [
        {"code": "print(7)", "language": "python", "run_timeout": 3, "compile_timeout": 3,
         "memory_limit_MB": 256, "stdin": "", "files": {}, "fetch_files": []}
    ]  # fmt: skip
    assert (result.stdout, result.exit_code, result.timed_out) == ("7\n", 0, False)
    assert result.isolation == "remote"
    assert run_remote("print(7)", LIMITS, service + "/run_code/").stdout == "7\n"


def test_failures_of_the_program_are_results(service):
    failed = run_remote("1/0", LIMITS, service)
    assert (failed.exit_code, failed.stderr, failed.timed_out) == (1, "ZeroDivisionError", False)
    late = run_remote("while True: pass", LIMITS, service)
    assert late.timed_out and late.killed_reason == "timeout" and late.exit_code is None
    long = run_remote("print('x' * 10**4)", LIMITS, service)
    assert long.stdout_truncated and len(long.stdout) == 100


@pytest.mark.parametrize(
    ("code", "message"),
    [
        ("broken", "status 'SandboxError' no runner for python"),
        ("http error", "answered HTTP 500"),
        ("not json", "not JSON"),
    ],
)
def test_failures_of_the_service_are_errors(service, code, message):
    with pytest.raises(RemoteSandboxError, match=message):
        run_remote(code, LIMITS, service)


def test_an_unreachable_service_and_an_oversized_answer_are_errors(service):
    with pytest.raises(RemoteSandboxError, match="cannot be reached"):
        run_remote("print(7)", LIMITS, "http://127.0.0.1:9")
    with pytest.raises(RemoteSandboxError, match="longer than 1000 bytes"):
        run_remote("print('x' * 10**4)", LIMITS, service, max_response_bytes=1000)


def test_the_environment_runs_its_calls_on_the_service(service):
    config = PythonSandboxConfig(backend="remote", url=service, syntax="hermes")
    env = python_sandbox_environment(config)
    step = env.step(
        ModelTurn(
            text='<tool_call>{"name": "python", "arguments": {"code": "print(7)"}}</tool_call>',
            ids=(),
            index=0,
        )
    )
    assert (step.observation, step.tool_calls, step.role) == ("7", 1, "tool")


def test_echo_last_expression_sends_the_rewritten_program(service):
    config = PythonSandboxConfig(backend="remote", url=service, echo_last_expression=True)
    step = python_sandbox_environment(config).step(
        ModelTurn(text="<call>3+4</call>", ids=(), index=0)
    )
    assert step.observation == "<result>7</result>"
