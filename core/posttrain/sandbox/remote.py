"""A client of a remote sandbox service speaking the SandboxFusion API (the one verl's code
rewards and tools use): ``POST {url}/run_code`` with ``{"code", "language", "run_timeout",
"compile_timeout", "memory_limit_MB", "stdin", "files", "fetch_files"}``, answered with
``{"status": "Success" | "Failed" | "SandboxError", "message", "compile_result", "run_result":
{"status": "Finished" | "TimeLimitExceeded" | "Error", "return_code", "stdout", "stderr",
"execution_time"}}``.

The isolation is the service's; the client bounds what it waits for (the run's timeout plus
``request_margin_s``) and what it reads (the response body, ``max_response_bytes``).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from posttrain.sandbox.result import SandboxLimits, SandboxResult, truncate


class RemoteSandboxError(RuntimeError):
    """The service could not run the code (unreachable, an HTTP error, a SandboxError status,
    an answer that is not the API's): a broken tool, not a mistake of the model's code."""


def run_code_url(url: str) -> str:
    """The endpoint: ``url`` as given when it names ``/run_code``, else ``url/run_code``."""
    url = url.rstrip("/")
    return url if url.endswith("/run_code") else f"{url}/run_code"


def run_remote(
    code: str,
    limits: SandboxLimits,
    url: str,
    *,
    language: str = "python",
    request_margin_s: float = 10.0,
    max_response_bytes: int = 4 * 2**20,
) -> SandboxResult:
    payload = {
        "code": code,
        "language": language,
        "run_timeout": limits.timeout_s,
        "compile_timeout": limits.timeout_s,
        "memory_limit_MB": limits.memory_mb,
        "stdin": "",
        "files": {},
        "fetch_files": [],
    }
    request = urllib.request.Request(
        run_code_url(url),
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json", "Accept": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=limits.timeout_s + request_margin_s) as reply:
            body = reply.read(max_response_bytes + 1)
    except urllib.error.HTTPError as exc:
        raise RemoteSandboxError(f"{run_code_url(url)} answered HTTP {exc.code}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise RemoteSandboxError(f"{run_code_url(url)} cannot be reached: {reason}") from None
    if len(body) > max_response_bytes:
        raise RemoteSandboxError(f"the answer is longer than {max_response_bytes} bytes")
    try:
        answer = json.loads(body)
    except json.JSONDecodeError as exc:
        raise RemoteSandboxError(f"the answer is not JSON ({exc.msg})") from None
    return _result(answer, limits)


def _result(answer: object, limits: SandboxLimits) -> SandboxResult:
    if not isinstance(answer, dict) or answer.get("status") not in ("Success", "Failed"):
        status = answer.get("status") if isinstance(answer, dict) else type(answer).__name__
        message = answer.get("message", "") if isinstance(answer, dict) else ""
        raise RemoteSandboxError(f"the service answered status {status!r} {message}".rstrip())
    compiled = answer.get("compile_result") or {}
    run = answer.get("run_result") or compiled  # a compile that failed has no run
    if not isinstance(run, dict):
        raise RemoteSandboxError("the answer's run_result is not a mapping")
    timed_out = run.get("status") == "TimeLimitExceeded"
    stdout, stderr = str(run.get("stdout") or ""), str(run.get("stderr") or "")
    cap = limits.max_output_bytes
    code = run.get("return_code")
    return SandboxResult(
        stdout=truncate(stdout, cap),
        stderr=truncate(stderr, cap),
        exit_code=code if isinstance(code, int) and not isinstance(code, bool) else None,
        timed_out=timed_out,
        killed_reason="timeout" if timed_out else None,
        stdout_truncated=len(stdout) > cap,
        stderr_truncated=len(stderr) > cap,
        isolation="remote",
    )
