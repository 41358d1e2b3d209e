"""Detectors on light and deep traces (issue 17): one injected fault captured by the real profiler
under each tier, a small real torch model decoding on its own thread. A light trace must measure
the same gaps and tokenization as a deep one (within 10%), and where the deep trace names an
op-level cause (a host copy between steps, an .item() every step) the light one says that cause
needs a deep window, never a cause read from the ops it did not record. The CUDA side (kernels
and runtime calls present, ops absent) runs on synthetic traces (tests/_kineto_builder.py)."""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
import torch.autograd.profiler as autograd_profiler
from _kineto_builder import KinetoTrace, eager_step
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile

from servprof.detect.analysis import Analysis, analyse
from servprof.phases import phase
from servprof.report.utilisation import step_bars_svg, utilisation_rows
from servprof.tiers import LightProfile, light_problem
from servprof.trace import load_trace

pytestmark = pytest.mark.skipif(light_problem() is not None, reason=f"no light capture on this torch: {light_problem()}")

REQUESTS = tuple(f"r{i}" for i in range(1, 8))  # a median over 7 tokenizations: robust to a preempted one
TOKENIZE_MS = 50.0  # busy-waits to a deadline: as long on a loaded host, unless preempted at its end
GAP_MS = 50.0  # between decode steps: host copies until a deadline (ops a deep trace records)
# (Long enough that a preemption of a few ms across a deadline on a busy host stays well under 10%.)
DECODE_STEPS = 10
# Causes read from what a thread did not record: a light trace must never conclude them.
ABSENCE_CAUSES = {"untraced_host_time", "host_python", "host_ops", "gil_contention", "host_read_per_step"}
DEEP_HOW = ("SERVPROF_DEEP_EVERY", "tier=deep", "SERVPROF_DEEP_STEPS")


class Engine:
    """A hand-written decode loop over a few nn.Linear layers, with a slow tokenizer and a host copy
    plus an .item() read between decode steps (the injected faults)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
        self.src = torch.randn(256 * 1024)
        self.dst = torch.empty_like(self.src)
        # The faults as they happened in the last run, on the engine's own clock (ms): a busy host
        # stretches a deadline by whatever preemption crosses it, differently in each run.
        self.gaps: list[float] = []
        self.tokenize: dict[str, float] = {}

    @staticmethod
    def _slow_tokenize() -> None:
        deadline = time.perf_counter() + TOKENIZE_MS / 1000
        while time.perf_counter() < deadline:
            sum(range(200))  # pure Python, as a slow normaliser: no op

    def _host_copies(self) -> None:
        deadline = time.perf_counter() + GAP_MS / 1000
        while time.perf_counter() < deadline:
            self.dst.copy_(self.src)

    def serve(self) -> None:
        self.gaps, self.tokenize = [], {}
        with torch.no_grad():
            for rid in REQUESTS:
                began = time.perf_counter()
                with phase("tokenize", request_id=rid):
                    self._slow_tokenize()
                self.tokenize[rid] = (time.perf_counter() - began) * 1000
            with phase("prefill", request_ids=list(REQUESTS)):
                self.model(torch.randn(len(REQUESTS) * 8, 256))
            x = torch.randn(len(REQUESTS), 256)
            left = 0.0
            for step in range(DECODE_STEPS):
                if step:
                    self.gaps.append((time.perf_counter() - left) * 1000)
                with phase("decode_step", request_ids=list(REQUESTS)):
                    logits = self.model(x)
                left = time.perf_counter()
                logits.argmax().item()  # the host reads the sampled token every step
                self._host_copies()

    def on_a_thread(self) -> None:
        thread = threading.Thread(target=self.serve, name="engine")
        thread.start()
        thread.join()


def capture(engine: Engine, tier: str, path: Path) -> Path:
    """The engine's run under the tier's profiler, with the tier in servprof's metadata as capture.py writes it."""
    assert not autograd_profiler._is_profiler_enabled  # never two profilers at once
    cls = LightProfile if tier == "light" else profile
    prof = cls(activities=[ProfilerActivity.CPU], experimental_config=_ExperimentalConfig(profile_all_threads=True))
    prof.start()
    engine.on_a_thread()
    prof.add_metadata_json("servprof", orjson.dumps({"tier": tier, "request_ids": list(REQUESTS)}).decode())
    prof.stop()
    prof.export_chrome_trace(str(path))
    return path


@pytest.fixture(scope="module")
def tiers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Analysis, dict[str, Any]]]:
    """tier -> (trace, analysis, the faults as the engine timed them in that run)."""
    folder = tmp_path_factory.mktemp("tiers")
    engine = Engine()
    # One intra-op thread: on a busy 2-core host a parallel op waits for its other threads for ms,
    # and the op that crosses a deadline would stretch the gap by that much.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine.on_a_thread()  # warm-up: first calls of each op, thread start-up
        out = {}
        for tier in ("light", "deep"):
            trace = load_trace(capture(engine, tier, folder / f"{tier}.json"))
            out[tier] = (trace, analyse(trace), {"gaps": engine.gaps, "tokenize": engine.tokenize})
    finally:
        torch.set_num_threads(threads)
    return out


def _between(analysis: Analysis) -> list[Any]:
    return [f for f in analysis.findings if f.kind == "decode_gap" and f.evidence["where"] == "between_steps"]


def _gap_ms(analysis: Analysis) -> list[float]:
    """Each gap of the between-steps findings (a finding lists up to 10: all of them here)."""
    return [g["idle_us"] / 1000 for f in _between(analysis) for g in f.evidence["worst_gaps"]]


def _tokenize_ms(analysis: Analysis) -> dict[str, float]:
    return {f.request_ids[0]: f.evidence["tokenize_ms"] for f in analysis.findings if f.kind == "tokenization_stall"}


def test_the_tiers_record_what_they_promise(tiers):
    light, deep = tiers["light"][0], tiers["deep"][0]
    assert not light.mask_category("cpu_op").any() and deep.mask_category("cpu_op").any()
    assert tiers["light"][1].summary["tier"] == "light" and tiers["deep"][1].summary["tier"] == "deep"


def test_gap_and_tokenization_magnitudes_agree_within_ten_percent(tiers):
    """Each tier's findings against the fault as its own run timed it, and the tiers against each
    other: on a busy host one run's 50 ms can be another's 60, in both tiers alike."""
    light, deep = tiers["light"][1], tiers["deep"][1]
    # Every gap between steps found on both. A busy host can stall a step itself: the deep trace may
    # add such gaps inside steps; the light one cannot see them.
    between = [[g for g in a.gaps if g.where == "between_steps"] for a in (light, deep)]
    assert [len(gaps) for gaps in between] == [DECODE_STEPS - 1] * 2
    assert all(g.where == "between_steps" for g in light.gaps)
    # (A host preempted for one gap can leave it alone in a cause too small to report: medians.)
    assert len(_gap_ms(light)) == DECODE_STEPS - 1 and len(_gap_ms(deep)) >= DECODE_STEPS - 3
    ratios: dict[str, tuple[float, float]] = {}
    for tier, (_, analysis, injected) in tiers.items():
        gap, tokenize = statistics.median(_gap_ms(analysis)), statistics.median(_tokenize_ms(analysis).values())
        assert gap >= GAP_MS and tokenize >= TOKENIZE_MS
        assert set(_tokenize_ms(analysis)) == set(REQUESTS)
        ratios[tier] = (gap / statistics.median(injected["gaps"]),
                        tokenize / statistics.median(injected["tokenize"].values()))
    for which in (0, 1):  # gap, tokenization
        light_ratio, deep_ratio = ratios["light"][which], ratios["deep"][which]
        assert 0.9 <= light_ratio <= 1.1 and 0.9 <= deep_ratio <= 1.1, ratios
        assert abs(light_ratio - deep_ratio) <= 0.10 * deep_ratio, ratios


def test_light_says_a_deep_window_is_needed_where_deep_names_the_op(tiers):
    light, deep = tiers["light"][1], tiers["deep"][1]
    # Deep: the host copy between steps is named by its op, and the .item() every step is found.
    deep_causes = {f.evidence["cause"] for f in _between(deep)}
    assert "host_ops" in deep_causes
    assert any("aten::copy_" in f.title for f in _between(deep) if f.evidence["cause"] == "host_ops")
    assert any(f.evidence.get("cause") == "host_read_per_step" for f in deep.findings)
    # Light: the same gaps, their cause left to a deep window, with how to get one.
    (gap,) = _between(light)
    assert gap.evidence["cause"] == "needs_deep_window"
    assert "op-level cause needs a deep window" in gap.title
    assert all(word in gap.fix for word in DEEP_HOW)
    assert not any(f.evidence.get("cause") == "host_read_per_step" for f in light.findings)
    assert "host_reads" not in light.summary["decode_gap"]  # no count of reads it could not see
    (entry,) = [m for m in light.summary["missing"] if m["what"] == "op-level detail (light trace)"]
    assert ".item()" in entry["message"] and "bandwidth" in entry["message"]
    assert all(word in entry["message"] for word in DEEP_HOW)
    assert not [m for m in deep.summary["missing"] if "light" in m["what"]]


def test_no_light_finding_names_a_cause_it_cannot_see(tiers):
    light = tiers["light"][1]
    for finding in light.findings:
        assert finding.evidence.get("cause") not in ABSENCE_CAUSES, finding.title
        assert "aten::" not in finding.title and "with_stack" not in finding.fix
    # The roofline needs op shapes: it says so, not "record_shapes" advice a light session cannot take.
    bandwidth = light.summary["bandwidth"]
    assert "light trace" in bandwidth["note"] and "SERVPROF_DEEP_EVERY" in bandwidth["note"]
    assert not [m for m in light.summary["missing"] if m["what"] == "op shapes"]
    # Busy time inside a step is not recorded: null, never 0% busy.
    util = light.summary["utilisation"]
    decode = next(a for a in util["aggregates"] if a["kind"] == "decode")
    assert decode["busy_ms"] is None and decode["idle_inside_pct"] is None and decode["idle_between_ms"] > 0
    assert "not split" in util["note"]
    assert "n/a" in utilisation_rows(light.summary)[0] and "not split" in step_bars_svg(light.summary)


# --- CUDA light traces (synthetic: kernels and runtime calls, no ops) ---------------------------

DECODE = "servprof:decode_step|r1"


def _python_between_steps(tier: str | None, frames: bool) -> KinetoTrace:
    """Six steps; between them the engine runs 500 µs of Python (recorded only as frames and ops)."""
    trace = KinetoTrace()
    trace.metadata = {"servprof": {"tier": tier}} if tier else {}
    t = 0.0
    for _ in range(6):
        trace.annotation(DECODE, t, 60)
        end = eager_step(trace, t, kernels=10)
        if frames:
            trace.frame("myapp/engine.py(10): prepare_batch", end + 20, 450)
            trace.host("aten::index", end + 200, 100)
        t = end + 500
    return trace


def _gap(analysis: Analysis) -> Any:
    (gap,) = [f for f in analysis.findings if f.kind == "decode_gap"]
    return gap


def test_light_cuda_gap_needs_a_deep_window_and_a_public_trace_is_judged_as_before(tmp_path: Path):
    deep = _gap(analyse(load_trace(_python_between_steps("deep", True).write(tmp_path / "d.json"))))
    public = _gap(analyse(load_trace(_python_between_steps(None, False).write(tmp_path / "p.json"))))
    light_analysis = analyse(load_trace(_python_between_steps("light", False).write(tmp_path / "l.json")))
    light = _gap(light_analysis)
    assert deep.evidence["cause"] == "host_python"
    assert public.evidence["cause"] == "untraced_host_time"  # no metadata: today's reading
    assert light.evidence["cause"] == "needs_deep_window" and all(w in light.fix for w in DEEP_HOW)
    assert light.evidence["median_gap_ms"] == pytest.approx(deep.evidence["median_gap_ms"])
    (entry,) = [m for m in light_analysis.summary["missing"] if "light" in m["what"]]
    assert "1 gap" not in entry["message"] and "5 gap(s)" in entry["message"]
    assert ".item()" not in entry["message"]  # on CUDA the copies a read makes are recorded
    assert light_analysis.summary["utilisation"]["mode"] == "device"
    assert light_analysis.summary["utilisation"]["aggregates"][0]["busy_ms"] is not None


def test_light_cuda_still_names_a_sync_the_runtime_recorded(tmp_path: Path):
    """.item() every step on CUDA: the DtoH copy and cudaStreamSynchronize are runtime calls, which a
    light trace keeps: the gap's cause is named from them, and the reads per step are counted."""
    trace = KinetoTrace()
    trace.metadata = {"servprof": {"tier": "light"}}
    t = 0.0
    for _ in range(6):
        end = eager_step(trace, t, kernels=10)
        trace.annotation(DECODE, t, end + 10 - t)
        h = t + 60
        trace.launch(h + 2, end, 4.0, name="Memcpy DtoH (Device -> Pageable)", runtime="cudaMemcpyAsync",
                     cat="gpu_memcpy")
        trace.host("cudaStreamSynchronize", h + 6, end + 4 - h, cat="cuda_runtime")
        t = end + 10 + 200
    gap = _gap(analyse(load_trace(trace.write(tmp_path / "t.json"))))
    assert gap.evidence["cause"] == "synchronize" and gap.evidence["host_reads_per_step"] == 1.0


def test_a_tokenizer_on_another_thread_is_shown_not_blamed_on_a_light_trace(tmp_path: Path):
    """The engine thread records nothing between steps while another thread tokenizes: a deep trace
    (the engine ran no op) may blame the GIL; a light one cannot tell, and says what ran meanwhile."""
    trace = KinetoTrace()
    t = 0.0
    for k in range(5):
        trace.annotation(DECODE, t, 60)
        end = eager_step(trace, t, kernels=10)
        trace.annotation(f"servprof:tokenize|q{k}", end + 10, 780, tid=2)
        t = end + 800
    public = _gap(analyse(load_trace(trace.write(tmp_path / "p.json"))))
    assert public.evidence["cause"] == "tokenization"  # (today's reading: the engine recorded no op)
    trace.metadata = {"servprof": {"tier": "light"}}
    gap = _gap(analyse(load_trace(trace.write(tmp_path / "t.json"))))
    assert gap.evidence["cause"] == "needs_deep_window"
    assert "meanwhile thread 2 was in servprof:tokenize|q" in gap.title
