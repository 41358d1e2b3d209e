"""The harness against a server that asks for an API key, as `vllm serve --api-key` does (401
without ``Authorization: Bearer <key>``, /v1/models included): real locust processes, the timed
test server on loopback (tests/_harness_helpers.py) with its key check on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from _harness_helpers import REPO_ROOT, TimedServer, read_summary, run_locust, running_server

KEY = "sk-harness-test"
RUN = ("--headless", "-u", "2", "-r", "2", "-t", "2s", "--max-output-tokens", "4")


@pytest.mark.parametrize(("args", "env"), [
    ([], {"OPENAI_API_KEY": KEY}),  # as vllm bench serve and OpenAI's clients read it
    (["--api-key", KEY], {}),
    # A header given replaces the key's (any case), and others go along.
    (["--api-key", "wrong", "--header", f"authorization: Bearer {KEY}", "--header", "X-Team: infra"], {}),
], ids=["OPENAI_API_KEY", "api_key_option", "header_option"])
def test_every_request_carries_the_key(tmp_path: Path, args: list[str], env: dict[str, str]) -> None:
    server = TimedServer(ttft_s=0.01, itl_s=0.005, max_chunks=4, api_key=KEY)
    summary_path = tmp_path / "s.json"
    with running_server(server):
        result = run_locust(server.url, *RUN, "--summary-json", str(summary_path), *args, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert server.refused == 0 and server.requests
    summary = read_summary(summary_path)
    assert summary["completed"] > 0 and summary["failed"] == 0
    assert {r.body["model"] for r in server.requests} == {"timed-test-model"}  # /v1/models answered too
    if "--header" in args:
        assert {r.headers.get("x-team") for r in server.requests} == {"infra"}
    # No secret in the summary file: the options it keeps say a key was given, not which.
    assert KEY.encode() not in summary_path.read_bytes() and b"wrong" not in summary_path.read_bytes()


def test_a_server_that_wants_a_key_is_named_once_as_the_reason(tmp_path: Path) -> None:
    server = TimedServer(ttft_s=0.01, itl_s=0.005, max_chunks=4, api_key=KEY)
    summary_path = tmp_path / "s.json"
    with running_server(server):
        result = run_locust(server.url, *RUN, "--summary-json", str(summary_path))
    summary = read_summary(summary_path)
    assert summary["completed"] == 0 and summary["failed"] > 1 and not server.requests
    hint = "servprof harness: the server answered HTTP 401 (no API key was sent): give its key with --api-key"
    assert result.stderr.count(hint) == 1, result.stderr[-3000:]


def test_a_header_without_a_name_stops_locust_with_a_clear_message() -> None:
    result = run_locust("http://127.0.0.1:9", "--headless", "-u", "1", "-t", "2s", "--header", "Bearer sk")
    assert result.returncode == 2
    assert "servprof harness: --header must be 'Name: value', got 'Bearer sk'" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_options_are_in_the_web_ui_and_the_key_is_masked() -> None:
    """locust's web UI lists the options a parser marks for it; an argument group's add_argument is
    argparse's and marks none (before: no harness option in the web UI). Run in a process of its
    own: importing locust patches the standard library through gevent."""
    code = ("import sys, orjson; sys.argv = ['locust', '-f', 'bench/locustfile.py']\n"
            "from locust.argument_parser import ui_extra_args_dict\nimport servprof.harness.plugin\n"
            "sys.stdout.buffer.write(orjson.dumps(ui_extra_args_dict(['-f', 'bench/locustfile.py'])))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=REPO_ROOT, timeout=60, check=True)
    shown = orjson.loads(done.stdout)
    assert {"dataset", "arrival", "rate", "slo", "endpoint", "model", "api_key"} <= set(shown)
    assert shown["api_key"]["is_secret"] and not shown["dataset"]["is_secret"]
    assert shown["arrival"]["choices"] and "header" not in shown


def test_the_options_are_listed_by_the_harness_module() -> None:
    done = subprocess.run([sys.executable, "-m", "servprof.harness", "--help"], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=60)
    assert done.returncode == 0 and "--api-key" in done.stdout and "--arrival" in done.stdout


def test_the_web_uis_form_sets_the_options_the_key_included(tmp_path: Path) -> None:
    """A run started from locust's web UI: what its form sends (as the browser posts it to /swarm)
    is what the users send, the API key and the harness options alike."""
    import os
    import time

    import httpx
    from _harness_helpers import free_port, locust_command

    server = TimedServer(ttft_s=0.01, itl_s=0.005, max_chunks=4, api_key=KEY)
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    with running_server(server):
        port = free_port()
        web = f"http://127.0.0.1:{port}"
        process = subprocess.Popen(locust_command(server.url, "--web-host", "127.0.0.1", "--web-port", str(port)),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=REPO_ROOT)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    page = httpx.get(web + "/").text
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline and process.poll() is None, "locust's web UI did not start"
                    time.sleep(0.2)
            assert '"api_key"' in page and '"max_output_tokens"' in page
            form = {"user_count": "2", "spawn_rate": "2", "host": server.url, "api_key": KEY, "endpoint": "chat",
                    "max_output_tokens": "3", "dataset": "synthetic", "dataset_path": "", "slo": "", "stream": "true"}
            assert httpx.post(web + "/swarm", data=form).json()["success"]
            while len(server.requests) < 4:
                assert time.monotonic() < deadline, "no request reached the server"
                time.sleep(0.1)
            httpx.get(web + "/stop")
        finally:
            process.terminate()
            process.communicate(timeout=30)
    assert server.refused == 0
    assert {(r.body["max_tokens"], "messages" in r.body) for r in server.requests} == {(3, True)}
