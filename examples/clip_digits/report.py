"""What a finished run shows: a table on the terminal, DIR/metrics.json and DIR/training.png."""
import json
import os


def format_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def _floor_reason(config: dict) -> str:
    if config.get("sample_ids", "none") == "none":
        return "same-digit pairs are indistinguishable"
    if config.get("targets") == "mask":
        return "the digit is the sample id, same-digit pairs masked out of the denominators"
    return "the digit is the sample id, same-digit pairs are all positives"


def summary_rows(metrics: dict) -> list[tuple[str, str]]:
    config = metrics["config"]
    rows = [
        ("zero-shot accuracy (held out)", f"{100 * metrics['zero_shot_accuracy']:.1f}%  "
                                          f"({metrics['num_test_images']} images never trained on)"),
        ("final loss", f"{metrics['final_loss']:.4f}  (floor {metrics['loss_floor']:.4f}: {_floor_reason(config)})"),
        (f"peak loss memory per rank ({config['loss']})", _mib(metrics["peak_loss_memory_bytes"])),
    ]
    for name, value in metrics.get("peak_loss_memory_bytes_by_loss", {}).items():
        if name != config["loss"]:
            rows.append((f"  for comparison: {name}", _mib(value)))
    rows += [
        ("optimizer bytes / param (all)", f"{metrics['optimizer_bytes_per_param']:.2f}"),
        (f"  text tower ({config['text_precision']})", f"{metrics['optimizer_bytes_per_param_text']:.2f}"),
        ("  image tower (fp32)", f"{metrics['optimizer_bytes_per_param_image']:.2f}"),
        ("steps x global batch", f"{config['steps']} x {config['batch_size']} on {metrics['world_size']} ranks "
                                  f"({metrics['device']}, {metrics['backend']})"),
        ("training throughput", f"{metrics['samples_per_second']:.0f} samples/s"),
        ("wall time", f"{metrics['wall_seconds']:.1f} s (training {metrics['train_seconds']:.1f} s)"),
    ]
    return rows


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB ({nbytes} bytes)"


def write_metrics(out_dir: str, metrics: dict) -> str:
    path = os.path.join(out_dir, "metrics.json")
    with open(path, "w") as f:
        json.dump(metrics, f, indent=1)
    return path


def plot_runs(path: str, runs: dict[str, dict], loss_floor: float, title: str) -> str:
    """Loss per step (left, with the floor no model can beat) and held-out zero-shot accuracy
    (right), one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(9, 3.4))
    for label, history in runs.items():
        ax_loss.plot(history["loss_steps"], history["loss"], lw=1, label=label)
        ax_acc.plot(history["eval_steps"], [100 * a for a in history["accuracy"]], marker=".", label=label)
    ax_loss.axhline(loss_floor, color="grey", lw=0.5, ls="--")
    ax_loss.annotate("floor: same-digit captions are interchangeable", (0, loss_floor), xytext=(2, 3),
                     textcoords="offset points", fontsize=7, color="grey")
    ax_loss.set(xlabel="step", ylabel="contrastive loss (global batch)")
    ax_acc.set(xlabel="step", ylabel="zero-shot accuracy, held out (%)", ylim=(0, 100))
    ax_acc.axhline(90, color="grey", lw=0.5, ls="--")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
