"""The console table of a ``bench`` result (the JSON holds everything; this is the summary)."""

from __future__ import annotations


def _size(num_bytes) -> str:
    if not num_bytes:
        return "-"
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.0f} MiB"


def _rate(value: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.2f} {prefix}{unit}"
    return f"{value:.1f} {unit}"


def _row(name: str, record: dict) -> list[str]:
    s = record["seconds"]
    peaks = ("peak_memory_bytes_actor_rank", "peak_memory_bytes_engine", "peak_memory_bytes_driver")
    peak = _size(max(record.get(key) or 0 for key in peaks))
    if "peak_memory_bytes_engine" in record and record["peak_memory_bytes_engine"] is None:
        peak += " (engines: n/a)"  # SGLang's memory is its scheduler processes', not measured
    if name == "sync":
        rate, ratio = f"{record['gb_per_s']:.2f} GB/s", f"{record['of_copy_ceiling']:.2f} of copy"
    elif name == "reward":
        rate = f"{record['responses_per_s']:,.0f} resp/s"
        ratio = f"{record['of_read_ceiling']:.2f} of text read"
    elif name == "step":
        rate = f"{record['generated_tokens_per_s']:,.0f} gen tok/s"
        ratio = (
            f"{record['of_ceiling']:.2f} of overlap bound"
            if record.get("asynchronous")
            else f"{record['overhead_share']:.1%} overhead"
        )
    else:
        rate = f"{record['tokens_per_s']:,.0f} tok/s ({record['tokens_per_s_per_device']:,.0f}/dev)"
        ratio = f"{record.get('of_matmul_ceiling', 0):.2f} of matmul"
        if "mfu" in record:
            ratio += f", MFU {record['mfu']:.1%}"
    return [name, f"{s['median']:.3f}", f"{s['spread']:.0%}", rate, peak, ratio]


def format_report(result: dict) -> str:
    """Ceilings, one line per phase, and the step's breakdown."""
    c = result["ceilings"]
    layout = result["config"]["layout"]
    lines = [
        f"device: {c.get('device', '?')}; actor tp {layout['tp_size']} pp {layout['pp_size']} on "
        f"{layout['world_size']} {'ranks' if layout['device'] == 'cpu' else 'devices'}; "
        f"{layout['num_engines']} {layout['engine']} engine(s){' colocated' if layout['colocate'] else ''}",
        f"ceilings: matmul {_rate(c['matmul_flops_per_s'], 'FLOP/s')} (all ranks at once, at the model's shapes)"
        + (f"; copy {_rate(c['copy_bytes_per_s'], 'B/s')}" if "copy_bytes_per_s" in c else "")
        + (
            f"; published peak {_rate(c['published_peak_flops_per_s_per_device'], 'FLOP/s')} per device"
            if "published_peak_flops_per_s_per_device" in c
            else ""
        ),
    ]
    rows = [["phase", "median s", "spread", "throughput", "peak mem", "of ceiling"]]
    rows += [_row(name, record) for name, record in result["phases"].items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    step = result["phases"].get("step")
    if step:
        parts = ", ".join(f"{name} {v['share']:.1%}" for name, v in step["phases"].items())
        lines.append(f"step breakdown (median shares): {parts}")
    return "\n".join(lines)
