"""The compact table ``make bench`` prints from the results, one or a few lines per section."""

from __future__ import annotations

from typing import Any


def table(results: dict[str, Any]) -> str:
    lines = [f"pvisor-host benchmark — {results['machine']['date']}, {results['machine']['cpus']} CPUs"]
    if "single" in results:
        s = results["single"]
        lines.append(f"single replay ({s['pairs']} interleaved runs each; medians, s): {s['median_seconds']}")
        for name, r in s["ratios"].items():
            lines.append(f"  pvisor-host {name}: {r['median']}x (spread {r['spread']})")
        lines.append(f"  pvisor-host phases: {s['phases_median_seconds']}")
    if "batch" in results:
        b = results["batch"]
        lines.append(f"batch of {b['items']} replay-only items (replays/min):")
        for workers, row in b["throughput"].items():
            lines.append(
                f"  {workers}: pvisor-host {row['pvisor-host_per_minute']}, shell loop "
                f"{row['shell_loop_per_minute']}, ratio {row['ratio']}x (spread {row['spread']})"
            )
        lines.append(f"  runsc/runc wall at W=4: {b['runsc_vs_runc_at_W=4']}x")
    if "scale" in results:
        for name, row in results["scale"]["rows"].items():
            lines.append(f"  {name}: {row['per_item_seconds']} s/item, peak RSS {row['peak_rss_mib']} MiB")
        lines.append(f"  per-item growth 100 → 5000: {results['scale']['per_item_growth_100_to_5000']}x")
    if "plan" in results:
        p = results["plan"]
        lines.append(
            f"batch --plan --json x{p['items']}: {p['per_item_seconds']} s/item, peak RSS {p['peak_rss_mib']} MiB"
        )
    if "cache" in results:
        c = results["cache"]
        lines.append(f"cached build vs a docker-py tag lookup: {c['ratio']['median']}x ({c['median_seconds']})")
    if "startup" in results:
        lines.append(f"start-up (s): {results['startup']['median_seconds']}")
    if "shared" in results:
        h = results["shared"]
        lines.append(
            f"two batches side by side ({h['items']} items, {h['images']} task images): {h['pair_vs_one']['median']}x "
            f"one batch (spread {h['pair_vs_one']['spread']}); cache peak {h['peak_accounted']} B, budget "
            f"{h['budget_bytes']} B; disk {h['peak_disk_sampled']} B ({h['pair_disk_vs_one']}x); both ok: "
            f"{h['both_ok']}; left: {h['left']}"
        )
    if "dataset" in results:
        d = results["dataset"]
        lines.append(
            f"dataset of {d['images']} task images x {d['items'] // d['images']} items (replays/min): "
            + ", ".join(f"{k} {v}" for k, v in d["per_minute"].items())
            + f"; {d['ratio_vs_shell_loop']}x the shell loop, {d['ratio_vs_pull_everything_first']}x pulling first"
        )
        lines.append(f"  first result (s): {d['first_result_seconds']}")
        lines.append(f"  peak of the batch's images {d['peak_image_bytes']} B within a budget of {d['budget_bytes']} B")
    if "swe" in results:
        w = results["swe"]
        lines.append(
            f"SWE-shaped dataset, {w['task_images']} task images on {w['environment_images']} environments, "
            f"{w['items']} items (replays/min): "
            + ", ".join(f"{k} {v}" for k, v in w["per_minute"].items())
            + f"; {w['ratio_vs_shell_loop']}x the shell loop, {w['ratio_vs_pull_everything_first']}x pulling first"
        )
        lines.append(f"  first result (s): {w['first_result_seconds']}")
        lines.append(f"  --plan: {w['plan']}")
    if "collect" in results:
        c = results["collect"]
        lines.append(
            f"collect, a {c['checkout_bytes'] // 2**20} MB checkout, 3 files changed: an item writes "
            f"{c['changes']['item_bytes']} B with changes, {c['full']['item_bytes']} B with full"
        )
    if "report" in results:
        for items, row in results["report"]["rows"].items():
            lines.append(f"report of {items} items: {row}")
        rows = results["report"].get("results")
        if rows:
            lines.append(
                f"results of {rows['items']} items to Parquet: {rows['results_seconds']} s, "
                f"{rows['results_peak_rss_mib']} MiB; pandas reading the same results.jsonl: "
                f"{rows['pandas_seconds']} s, {rows['pandas_peak_rss_mib']} MiB ({rows['time_ratio']}x)"
            )
    if "gateway" in results:
        g = results["gateway"]
        for row, added in g["added_latency"].items():
            lines.append(f"gateway, {row}: added ms {added}")
        lines.append(f"gateway, 32 streams of 10 MB: {g['big_streams']}")
    if "fork" in results and "skipped" in results["fork"]:
        lines.append(f"--fork: skipped: {results['fork']['skipped']}")
    elif "fork" in results:
        f = results["fork"]
        lines.append(
            f"--fork {f['forks']} against {f['forks']} replays ({f['pairs']} pairs, a prefix of "
            f"{f['prefix_run_s']} s): core-seconds {f['core_ratio']}x "
            f"(spread {f['core_ratio_spread']}, target <= 0.35), wall {f['wall_ratio']}x (spread "
            f"{f['wall_ratio_spread']}, target <= 0.5)"
        )
        for agent in ("claude-code", "codex"):
            lines.append(f"  {agent} checkpoint: {f[agent]}")
    if "cluster" in results:
        c = results["cluster"]
        if "items" in c:  # not with --only cluster-tasks
            lines.append(
                f"cluster, {c['items']} replay-only items, {c['slots_per_node']} slots per node: wall against a "
                f"local batch at the same width {c['cluster_vs_local_wall']['median']}x; replays/min "
                + ", ".join(f"{k} {v['per_minute']}" for k, v in c["throughput"].items())
                + f"; node memory {c['node_memory_mib']}"
            )
        if "task_images" in c:
            lines.append(f"cluster task images: {c['task_images']}")
    return "\n".join(lines)
