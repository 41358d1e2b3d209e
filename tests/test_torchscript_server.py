"""A server whose model is a TorchScript ScriptModule (how some teams ship models): the hand-written
loop server of tests/servers with its model passed through ``torch.jit.script``, served by uvicorn
under the one-line middleware. ScriptModules refuse Python hooks of their own; registering them
used to raise inside the server's model call, and the request never finished. Now every request
is answered and every step marked (by the global hooks, kept on for such a model)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import torch
from _server_session import session_on
from torch.nn.modules import module as torch_module

MAX_TOKENS = 24
REQUESTS = 2


@pytest.fixture
def scripted_server(monkeypatch: pytest.MonkeyPatch) -> Any:
    server = importlib.import_module("servers.handwritten_loop")
    monkeypatch.setattr(server, "model", torch.jit.script(server.model))
    return server


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_every_request_is_answered_and_every_step_marked(scripted_server: Any, tmp_path: Path) -> None:
    out = session_on("servers.handwritten_loop", tmp_path, ["/v1/completions"] * REQUESTS, MAX_TOKENS)
    assert [status for _path, status, _rid in out["responses"]] == [200] * REQUESTS
    auto = out["session"]["auto"]
    assert auto["models_marked_by_global_hooks"] == ["RecursiveScriptModule"]
    assert auto["problem"] is None
    # Each request: the prompt's forward, then one per token generated.
    assert (auto["prefill"], auto["decode"]) == (REQUESTS, REQUESTS * MAX_TOKENS)
    phases = {rid: [p["name"] for p in request["phases"]] for rid, request in out["result"]["requests"].items()}
    for _path, _status, rid in out["responses"]:
        assert phases[rid].count("prefill") == 1 and phases[rid].count("decode_step") == MAX_TOKENS
    assert not torch_module._global_forward_pre_hooks and not torch_module._global_forward_hooks
