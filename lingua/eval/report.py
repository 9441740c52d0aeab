"""Tables of GLUE probe results in the paper's layout (columns in its order, then the average)."""

from lingua.eval.glue_data import TASKS


def format_table(results: dict) -> str:
    """The paper's layout (one row per probe and layer, the tasks in its column order, their average), preceded,
    for a single layer, by one row per task with its other metrics and the chosen λ or k."""
    lines = []
    if len(results["layers"]) == 1:
        lines += _task_rows(results, results["layers"][0])
    lines.append(f"{'probe':<16}" + "".join(f"{t.title:>6}" for t in TASKS.values()) + f"{'Avg.':>6}")
    for layer, per_probe in results["summary"].items():
        for probe, scores in per_probe.items():
            cells = "".join(f"{scores[name]:>6.1f}" if name in scores else f"{'-':>6}" for name in TASKS)
            lines.append(f"{probe + ('' if layer == 'last' else f' L{layer}'):<16}{cells}{scores['avg']:>6.1f}")
    if results["skipped"]:
        lines.append(f"Avg. over the {len(results['tasks'])} tasks evaluated; skipped: "
                     + "; ".join(f"{TASKS[name].title} ({why})" for name, why in results["skipped"].items()))
    return "\n".join(lines)


def _task_rows(results: dict, layer: str) -> list[str]:
    probe_names = list(results["summary"][layer])
    lines = [f"GLUE frozen probes, layer {layer}: validation scores in %",
             f"{'task':<6} {'metric':<9} {'train':>6} {'dev':>6}" + "".join(f"{p:>8}" for p in probe_names)
             + "  details"]
    for name, r in results["tasks"].items():
        task, per_probe = TASKS[name], r["layers"][layer]
        details = "; ".join(f"{p}: " + ", ".join([f"{m} {v:.1f}" for m, v in per_probe[p]["metrics"].items()
                                                  if m != task.headline] + [_best(per_probe[p]["best"])])
                            for p in probe_names)
        lines.append(f"{task.title:<6} {task.headline:<9} {r['n_train']:>6} {r['n_dev']:>6}"
                     + "".join(f"{per_probe[p]['score']:>8.1f}" for p in probe_names) + f"  {details}")
    return lines + [""]


def _best(best: dict) -> str:
    if "lambda" in best:
        return f"λ={best['lambda']:.3g}"
    return f"k={best['k']} {best['distance']}"
