"""Locust wiring for the harness: command-line options, per-process state, the merge of
workers' samples on the master, and the summary at the end of a run.

Imported by servprof.harness.users, so any locustfile that uses OpenAIUser gets the
options (in the web UI too; locust's `--help` is printed before a locustfile is imported, so
`python -m servprof.harness --help` lists them) and the summary.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import gevent
from locust import events
from locust.env import Environment
from locust.runners import MasterRunner, WorkerRunner

from servprof.harness.arrivals import ARRIVALS, ArrivalError, Pacer
from servprof.harness.custom import TemplateError, parse_template
from servprof.harness.datasets import DATASET_NAMES, DatasetError, RequestSpec, load_dataset, replay_offsets
from servprof.harness.summary import (
    Collector,
    SLOError,
    parse_slo,
    summarize,
    summary_table,
    write_requests_jsonl,
    write_summary_json,
)

logger = logging.getLogger("servprof.harness")
REPORT_KEY = "servprof_harness"
# Workers report every 3 s (locust's WORKER_REPORT_INTERVAL); wait a bit longer than that
# after a stop from the web UI before the master summarises.
_MASTER_SUMMARY_DELAY_S = 3.5
# The report_to_master / worker_report events carry no environment; one process runs one.
_process_environment: Environment | None = None


@dataclass
class HarnessOptions:
    dataset: str = "synthetic"
    dataset_path: str | None = None
    num_requests: int = 1000
    seed: int = 0
    max_output_tokens: int = 0
    max_input_tokens: int = 0
    arrival: str = "closed"
    rate: float = 1.0
    burstiness: float = 1.0
    slo: dict[str, float] = field(default_factory=dict)
    endpoint: str = "completions"
    path: str = ""  # the URL path to POST; default: the endpoint's (custom: required)
    body: str = ""  # custom: the JSON body template (servprof.harness.custom)
    tokens_field: str = ""  # custom: dotted path of the output-token count in the answer
    stream: bool = True
    model: str = ""
    ignore_eos: bool = False
    summary_json: str | None = None
    requests_jsonl: str | None = None
    api_key: str = ""  # sent as "Authorization: Bearer <key>"; default: $OPENAI_API_KEY
    header: list[str] = field(default_factory=list)  # --header "Name: value", repeatable

    @classmethod
    def from_parsed(cls, parsed: Any) -> HarnessOptions:
        """Options from locust's parsed_options; SLOError on a bad --slo."""
        defaults = cls()
        values = {name: getattr(parsed, name, getattr(defaults, name)) for name in cls.__dataclass_fields__}
        values["slo"] = parse_slo(getattr(parsed, "slo", None))
        values["header"] = list(values["header"] or [])
        return cls(**values)

    def public(self) -> dict[str, Any]:
        """The options as the summary JSON keeps them: no secret (the key, header values) in a file."""
        return {**self.__dict__, "api_key": "(given)" if self.api_key else "",
                "header": [line.partition(":")[0].strip() + ": (given)" for line in self.header]}


@dataclass
class HarnessState:
    options: HarnessOptions
    specs: list[RequestSpec]
    pacer: Pacer | None  # None on the master, which sends no requests
    collector: Collector = field(default_factory=Collector)
    model: str | None = None
    finished: bool = False
    template: Any = None  # custom: the parsed --body
    headers: dict[str, str] = field(default_factory=dict)  # sent with every request (request_headers)
    refusal_logged: bool = False


ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def check_endpoint(options: HarnessOptions) -> Any:
    """The parsed --body of a custom endpoint (None for OpenAI's); TemplateError when the options
    do not describe a request."""
    if options.endpoint not in (*ENDPOINT_PATHS, "custom"):
        raise TemplateError(f"--endpoint must be completions, chat or custom, got {options.endpoint!r}")
    if options.path and not options.path.startswith("/"):
        raise TemplateError(f"--path must start with '/', got {options.path!r}")
    if options.endpoint != "custom":
        return None
    if not options.path or not options.body:
        raise TemplateError("--endpoint custom needs --path (where to POST) and --body (the JSON template), e.g. "
                            "--path /generate --body '{\"prompt\": \"{prompt}\", \"max_tokens\": \"{max_tokens}\"}'")
    return parse_template(options.body)


def request_headers(options: HarnessOptions) -> dict[str, str]:
    """What every request carries: ``Authorization: Bearer <--api-key>`` (else $OPENAI_API_KEY, as
    `vllm bench serve` and OpenAI's clients read it; a server started with `vllm serve --api-key`
    answers 401 without it), then each ``--header "Name: value"`` (which may replace it: a
    gateway's ``x-api-key``, Azure's ``api-key``). TemplateError on a header without a name."""
    key = options.api_key or os.environ.get("OPENAI_API_KEY", "")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for line in options.header:
        name, colon, value = line.partition(":")
        if not colon or not name.strip() or any(c.isspace() for c in name.strip()):
            raise TemplateError(f"--header must be 'Name: value', got {line!r}")
        given = name.strip()
        for existing in [n for n in headers if n.lower() == given.lower()]:
            del headers[existing]
        headers[given] = value.strip()
    return headers


def load_specs(options: HarnessOptions) -> list[RequestSpec]:
    return load_dataset(
        options.dataset,
        options.dataset_path,
        seed=options.seed,
        num_requests=options.num_requests,
        max_output_tokens=options.max_output_tokens or None,
        max_input_tokens=options.max_input_tokens or None,
    )


def build_state(environment: Environment) -> HarnessState:
    """Options, dataset and pacer for this process; raises DatasetError/ArrivalError/SLOError."""
    options = HarnessOptions.from_parsed(environment.parsed_options)
    template = check_endpoint(options)
    headers = request_headers(options)
    runner = environment.runner
    if isinstance(runner, MasterRunner):
        return HarnessState(options, [], None, template=template, headers=headers)
    specs = load_specs(options)
    worker_index, worker_count = 0, 1
    if isinstance(runner, WorkerRunner):
        worker_index = max(runner.worker_index, 0)
        worker_count = max(int(getattr(environment.parsed_options, "expect_workers", 1) or 1), 1)
        if worker_index >= worker_count:
            raise ArrivalError(
                f"worker index {worker_index} but the master expects {worker_count} workers: "
                "start the master with --expect-workers equal to the number of workers"
            )
    pacer = Pacer(
        options.arrival,
        rate=options.rate,
        burstiness=options.burstiness,
        seed=options.seed,
        replay=replay_offsets(specs) if options.arrival == "replay" else None,
        worker_index=worker_index,
        worker_count=worker_count,
    )
    return HarnessState(options, specs, pacer, template=template, headers=headers)


def harness_state(environment: Environment) -> HarnessState:
    state = getattr(environment, "servprof_harness", None)
    if state is None:
        state = build_state(environment)
        environment.servprof_harness = state  # type: ignore[attr-defined]
    return state


def summary_path(environment: Environment, options: HarnessOptions) -> str | None:
    """--summary-json, else next to locust's CSVs when --csv is given."""
    if options.summary_json:
        return options.summary_json
    prefix = getattr(environment.parsed_options, "csv_prefix", None)
    return f"{prefix}_servprof_summary.json" if prefix else None


def finish(environment: Environment, state: HarnessState | None = None) -> dict[str, Any] | None:
    """Summarise a run once: print the table and write the JSON."""
    state = state or getattr(environment, "servprof_harness", None)
    if state is None or state.finished:
        return None
    state.finished = True
    summary = summarize(state.collector, state.options.slo, state.options.public())
    path = summary_path(environment, state.options)
    if path:
        write_summary_json(summary, path)
    if state.options.requests_jsonl:
        write_requests_jsonl(state.collector, state.options.requests_jsonl)
    from rich.console import Console

    console = Console(file=sys.stdout, width=120)
    console.print(summary_table(summary))
    if path:
        console.print(f"servprof harness summary: {path}")
    return summary


@events.init_command_line_parser.add_listener
def add_arguments(parser: Any) -> None:
    group = parser.add_argument_group("servprof harness", "LLM traffic for OpenAI-compatible servers, or any "
                                      "JSON API (--endpoint custom)")

    def option(*names: str, web_ui: bool = True, secret: bool = False, **kwargs: Any) -> None:
        # An argument group's add_argument is argparse's own: the flags by which locust's web UI
        # lists an option (LocustArgumentParser.add_argument sets them) are set here.
        action = group.add_argument(*names, **kwargs)
        action.include_in_web_ui, action.is_secret, action.is_required, action.is_multiple = web_ui, secret, False, False

    option("--dataset", choices=DATASET_NAMES, default="synthetic", help="traffic dataset")
    option("--dataset-path", default=None, help="file for --dataset sharegpt|custom|trace")
    option("--num-requests", type=int, default=1000, help="size of the synthetic mix")
    option("--seed", type=int, default=0, help="seed of the synthetic mix and the arrival schedule")
    option("--max-output-tokens", type=int, default=0, help="cap on output tokens per request (0: none)")
    option("--max-input-tokens", type=int, default=0, help="cut prompts to this many words (0: no cut)")
    option("--arrival", choices=ARRIVALS, default="closed", help="arrival process (open loop unless closed)")
    option("--rate", type=float, default=1.0, help="mean arrivals per second (poisson, gamma)")
    option("--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, <1 burstier")
    option("--slo", default="", help="goodput SLOs in ms, e.g. ttft=500,tpot=50,e2e=5000")
    option("--endpoint", choices=(*ENDPOINT_PATHS, "custom"), default="completions",
           help="API to call: OpenAI's completions or chat, or custom (with --path and --body)")
    option("--path", default="", help="URL path to POST (default: the endpoint's; needed for custom)")
    option("--body", default="", help='custom: JSON body template, e.g. \'{"prompt": "{prompt}", '
           '"max_tokens": "{max_tokens}"}\' ("{stream}" too)')
    option("--tokens-field", default="", help="custom: dotted path of the output-token count in the "
           "answer, e.g. usage.completion_tokens (default: one per streamed chunk, else the words)")
    option("--stream", action=argparse.BooleanOptionalAction, default=True, help="stream tokens (SSE)")
    option("--model", default="", help="model name (default: first of GET /v1/models)")
    option("--ignore-eos", action="store_true", default=False, help="send ignore_eos (vLLM)")
    option("--summary-json", default=None, help="summary JSON path (default: next to --csv files)")
    option("--requests-jsonl", default=None, help="write one line per completed request here")
    option("--api-key", default="", secret=True,
           help="sent as 'Authorization: Bearer KEY' (vllm serve --api-key; default: $OPENAI_API_KEY)")
    option("--header", action="append", default=None, metavar="'NAME: VALUE'", web_ui=False,
           help="a header sent with every request, repeatable (e.g. 'x-api-key: KEY')")


@events.init.add_listener
def _validate_options(environment: Environment, **_kwargs: Any) -> None:
    # Fail fast with a clear message on the process that owns the options; workers get
    # theirs from the master when the run starts.
    if isinstance(environment.runner, WorkerRunner) or environment.parsed_options is None:
        return
    try:
        options = HarnessOptions.from_parsed(environment.parsed_options)
        check_endpoint(options)
        request_headers(options)
        specs = load_specs(options)
        replay = replay_offsets(specs) if options.arrival == "replay" else None
        Pacer(options.arrival, rate=options.rate, burstiness=options.burstiness, replay=replay)
    except (DatasetError, ArrivalError, SLOError, TemplateError) as exc:
        sys.stderr.write(f"servprof harness: {exc}\n")
        sys.exit(2)


@events.test_start.add_listener
def _on_test_start(environment: Environment, **_kwargs: Any) -> None:
    environment.servprof_harness = None  # type: ignore[attr-defined]
    try:
        harness_state(environment)
    except (DatasetError, ArrivalError, SLOError, TemplateError) as exc:
        logger.error("servprof harness: %s", exc)


@events.init.add_listener
def _remember_environment(environment: Environment, **_kwargs: Any) -> None:
    global _process_environment
    _process_environment = environment


@events.report_to_master.add_listener
def _on_report_to_master(client_id: str, data: dict[str, Any]) -> None:
    # On a worker: send the samples taken since the last report.
    state = getattr(_process_environment, "servprof_harness", None)
    if state is not None:
        data[REPORT_KEY] = state.collector.drain()


@events.worker_report.add_listener
def _on_worker_report(client_id: str, data: dict[str, Any]) -> None:
    # On the master: merge a worker's samples.
    state = getattr(_process_environment, "servprof_harness", None)
    if state is not None and REPORT_KEY in data:
        state.collector.merge(data[REPORT_KEY], client_id)


@events.test_stop.add_listener
def _on_test_stop(environment: Environment, **_kwargs: Any) -> None:
    if isinstance(environment.runner, WorkerRunner):
        return
    if isinstance(environment.runner, MasterRunner):
        # Workers' last samples are still on their way; quitting (headless) summarises
        # sooner, this covers a stop from the web UI.
        state = getattr(environment, "servprof_harness", None)
        gevent.spawn_later(_MASTER_SUMMARY_DELAY_S, finish, environment, state)
    else:
        finish(environment)


@events.quitting.add_listener
def _on_quitting(environment: Environment, **_kwargs: Any) -> None:
    if not isinstance(environment.runner, WorkerRunner):
        finish(environment)
