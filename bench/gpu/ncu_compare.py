"""servprof's achieved GB/s per decode op against Nsight Compute's DRAM counters (issue 15).

    python bench/gpu/ncu_compare.py TRACE.json.gz NCU.csv [--json OUT]   # one batch size
    python bench/gpu/ncu_compare.py --fixture tests/fixtures/gpu_decode   # every batch in the fixture

The torch.profiler trace and the ncu run are the same decode step in two processes
(bench/gpu/decode_step.py): the same kernels in the same order, so the n-th kernel of the
trace is the n-th kernel ncu profiled (their names are checked). servprof's side is the
bandwidth detector's own: the modelled ops it counts (``_outermost_modelled``), each one's
bytes from its shapes and its time from the kernels it launched (``launched_by``, ``device_time``). ncu's side,
for the same kernels: ``dram__bytes_read.sum + dram__bytes_write.sum`` over
``gpu__time_duration.sum``. The ops judged are those whose kernels carry the step's time, the
longest first, until 80% of the step's kernel time is covered.
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from servprof.detect.bandwidth_bound_decode import _outermost_modelled
from servprof.detect.byte_models import MODELLED, op_family
from servprof.detect.op_time import device_time, launched_by
from servprof.trace.loader import load_trace
from servprof.trace.model import Trace

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum")
COVERED_SHARE = 0.8
TOLERANCE = 0.10
# An op this large reads and writes DRAM for most of its bytes (weights, the KV cache), so ncu's DRAM
# counters measure its traffic; a smaller one's tensors can live in L2 (a write need never reach DRAM
# during the kernel), where DRAM counters say nothing about the bytes the op moved.
LARGE_OP_BYTES = 1 << 20


def read_ncu_csv(text: str) -> list[dict[str, Any]]:
    """ncu --csv --page raw --print-units base rows, in profiling order: name, bytes, ns."""
    rows = list(csv.DictReader(io.StringIO(text[text.find('"ID"'):])))
    kernels = []
    for row in rows:
        if not row.get("ID", "").strip().isdigit():  # the units row
            continue
        values = {m: float(row[m].replace(",", "")) for m in METRICS}
        kernels.append({"id": int(row["ID"]), "name": row["Kernel Name"],
                        "dram_bytes": values["dram__bytes_read.sum"] + values["dram__bytes_write.sum"],
                        "duration_ns": values["gpu__time_duration.sum"]})
    return sorted(kernels, key=lambda k: k["id"])


def _kernel_rows(trace: Trace) -> np.ndarray:
    rows = np.flatnonzero(trace.device_mask() & trace.mask_category("kernel", "Kernel"))
    return rows[np.argsort(trace.ts[rows], kind="stable")]


def _base_name(name: str) -> str:
    """A kernel's function name without its template arguments and parameters, as ncu prints it."""
    name = re.sub(r"^void\s+", "", name.strip()).replace("(anonymous namespace)::", "")
    depth, out = 0, []
    for char in name:
        if char == "<":
            depth += 1
        elif char == ">":
            depth -= 1
        elif char == "(" and depth == 0:
            break
        elif depth == 0:
            out.append(char)
    return "".join(out).split("::")[-1].strip()


def compare(trace: Trace, ncu: list[dict[str, Any]]) -> dict[str, Any]:
    kernels = _kernel_rows(trace)
    if len(kernels) != len(ncu):
        raise ValueError(f"the trace has {len(kernels)} kernels, ncu profiled {len(ncu)}: not the same step")
    names_differ = sum(_base_name(trace.name(int(r))) != _base_name(k["name"]) for r, k in zip(kernels.tolist(), ncu, strict=True))
    index_of = {int(row): i for i, row in enumerate(kernels.tolist())}
    rows = np.flatnonzero(trace.mask_name(MODELLED.__contains__, trace.host_names()) & trace.complete()
                          & (trace.stream < 0))
    taken, costs = _outermost_modelled(trace, rows)
    times = device_time(trace, taken)
    step_kernel_us = float(trace.dur[kernels].sum())
    launched, by_op = launched_by(trace, taken)  # the detector's own attribution of device work to ops
    is_kernel = np.isin(launched, kernels)
    launched, by_op = launched[is_kernel], by_op[is_kernel]
    ops = []
    for i, (row, cost, time_us) in enumerate(zip(taken.tolist(), costs, times.tolist(), strict=True)):
        mine = launched[by_op == i]
        mine = mine[np.argsort(trace.ts[mine], kind="stable")]
        if not mine.size or not time_us > 0:
            continue
        measured = [ncu[index_of[int(k)]] for k in mine.tolist()]
        ncu_bytes = sum(k["dram_bytes"] for k in measured)
        ncu_us = sum(k["duration_ns"] for k in measured) / 1e3
        servprof_gbs = cost.bytes / (time_us * 1e-6) / 1e9
        ncu_gbs = ncu_bytes / (ncu_us * 1e-6) / 1e9 if ncu_us > 0 else float("nan")
        ops.append({"op": trace.name(row), "family": op_family(trace.name(row)), "shapes": cost.shapes,
                    "kernels": [_base_name(trace.name(int(k))) for k in mine.tolist()],
                    "time_us": time_us, "bytes": cost.bytes, "servprof_gbs": servprof_gbs,
                    "ncu_us": ncu_us, "ncu_bytes": ncu_bytes, "ncu_gbs": ncu_gbs,
                    "gbs_ratio": servprof_gbs / ncu_gbs if ncu_gbs > 0 else float("nan"),
                    "bytes_ratio": cost.bytes / ncu_bytes if ncu_bytes > 0 else float("nan")})
    by_time = sorted(ops, key=lambda o: -o["time_us"])
    judged, covered = [], 0.0
    for op in by_time:
        if covered >= COVERED_SHARE * step_kernel_us:
            break
        judged.append(op)
        covered += op["time_us"]
    large = [o for o in ops if o["bytes"] >= LARGE_OP_BYTES]
    return {"kernels": len(kernels), "kernel_names_differ": names_differ, "step_kernel_us": step_kernel_us,
            "modelled_kernel_us": sum(o["time_us"] for o in ops), "judged_share": covered / step_kernel_us,
            "ops": ops, "judged": judged,
            "within": sum(abs(o["gbs_ratio"] - 1) <= TOLERANCE for o in judged),
            "large": large, "large_share": sum(o["time_us"] for o in large) / step_kernel_us}


def ncu_fixture_rows(ncu: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the fixture keeps of an ncu run: per kernel in order, its function name and the two figures."""
    return [{"name": _base_name(k["name"]), "dram_bytes": k["dram_bytes"], "duration_ns": k["duration_ns"]}
            for k in ncu]


def families(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per op family over the judged ops: time, servprof's and ncu's GB/s (bytes over time summed)."""
    out: dict[str, dict[str, float]] = {}
    for op in result["judged"]:
        f = out.setdefault(op["family"], {"ops": 0, "time_us": 0.0, "bytes": 0.0, "ncu_bytes": 0.0, "ncu_us": 0.0})
        f["ops"] += 1
        for key in ("time_us", "bytes", "ncu_bytes", "ncu_us"):
            f[key] += op[key]
    for f in out.values():
        f["servprof_gbs"] = f["bytes"] / f["time_us"] / 1e3
        f["ncu_gbs"] = f["ncu_bytes"] / f["ncu_us"] / 1e3
        f["share_of_step"] = f["time_us"] / result["step_kernel_us"]
    return out


def _add_to_fixture(folder: Path, batch: str | None, trace: Path, ncu: list[dict[str, Any]]) -> None:
    if not batch:
        raise SystemExit("--write-fixture needs --batch")
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(trace, folder / f"decode_b{batch}.json.gz")
    index = folder / "ncu.json"
    recorded = orjson.loads(index.read_bytes()) if index.exists() else {"metrics": list(METRICS), "batches": {}}
    recorded["batches"][batch] = ncu_fixture_rows(ncu)
    index.write_bytes(orjson.dumps(recorded))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", nargs="?")
    parser.add_argument("ncu", nargs="?", help="ncu --csv --page raw --print-units base output")
    parser.add_argument("--fixture", type=Path, help="a folder of decode_bN.json.gz + ncu.json (tests/fixtures)")
    parser.add_argument("--json", type=Path, help="write every op's figures here")
    parser.add_argument("--write-fixture", type=Path, metavar="DIR",
                        help="with TRACE and NCU: add this batch (--batch) to the fixture in DIR")
    parser.add_argument("--batch", help="the batch size of TRACE and NCU (--write-fixture)")
    args = parser.parse_args()
    if args.fixture:
        recorded = orjson.loads((args.fixture / "ncu.json").read_bytes())
        runs = {b: (load_trace(args.fixture / f"decode_b{b}.json.gz"), recorded["batches"][b]) for b in recorded["batches"]}
    elif args.trace and args.ncu:
        ncu = read_ncu_csv(Path(args.ncu).read_text())
        runs = {args.batch or "?": (load_trace(args.trace), ncu)}
        if args.write_fixture:
            _add_to_fixture(args.write_fixture, args.batch, Path(args.trace), ncu)
    else:
        parser.error("give TRACE and NCU, or --fixture")
    results = {}
    for batch, (trace, ncu) in runs.items():
        result = results[batch] = compare(trace, ncu)
        print(f"batch {batch}: {result['kernels']} kernels ({result['kernel_names_differ']} names differ), "
              f"step {result['step_kernel_us']:.0f} µs, judged {len(result['judged'])} ops = "
              f"{result['judged_share']:.0%} of it, {result['within']} within ±{TOLERANCE:.0%}")
        large = result["large"]
        if large:
            bytes_ratios = [o["bytes_ratio"] for o in large]
            gbs_ratios = [o["gbs_ratio"] for o in large]
            print(f"  ops moving >= 1 MiB: {len(large)}, {result['large_share']:.0%} of the step; bytes / ncu's DRAM "
                  f"bytes {min(bytes_ratios):.3f}..{max(bytes_ratios):.3f}, GB/s / ncu's {min(gbs_ratios):.2f}.."
                  f"{max(gbs_ratios):.2f}")
        for name, f in sorted(families(result).items(), key=lambda kv: -kv[1]["time_us"]):
            print(f"  {name:<12} {f['ops']:>4} ops {f['share_of_step']:>5.0%} of step  servprof "
                  f"{f['servprof_gbs']:>7.0f} GB/s  ncu {f['ncu_gbs']:>7.0f} GB/s  ratio "
                  f"{f['servprof_gbs'] / f['ncu_gbs']:.2f}  bytes ratio {f['bytes'] / f['ncu_bytes']:.2f}")
        for op in result["judged"]:
            if abs(op["gbs_ratio"] - 1) > TOLERANCE:
                print(f"    off: {op['op']} {op['shapes']} {op['time_us']:.1f} µs servprof {op['servprof_gbs']:.0f} "
                      f"ncu {op['ncu_gbs']:.0f} GB/s (bytes {op['bytes']:.3g} vs {op['ncu_bytes']:.3g}) {op['kernels']}")
    if args.json:
        args.json.write_bytes(orjson.dumps(results, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
