"""Convergence of asynchronous pipeline training (XPipe) on real data that ships offline.

Data: the handwritten digits that scikit-learn ships inside its package (1797 images of
8x8 pixels, 10 classes; ``sklearn.datasets.load_digits``, no download). Install it with::

    pip install scikit-learn          # or: pip install -e .[bench]

Model: an MLP 64 → 64 → 64 → 64 → 10 (``--hidden``) cut into K = 4 stages (one Linear per stage).
Every policy (sync, stale, stash, predict) trains from the same initial weights on the
same mini-batches in the same order, with the same optimizer and hyper-parameters, for the
same number of mini-batches, and the same cosine learning-rate decay (stepped per mini-batch
inside the pipeline); validation loss and accuracy (on a held-out 30%) are measured
every ``--eval-every`` mini-batches, at a drained point of the stream. The learning rates
are chosen high enough that staleness matters (at a small lr the policies cannot be told
apart, and the comparison would say nothing): Adam 1e-2, SGD 0.1 with momentum 0.9, M = 1
micro-batch per mini-batch (the most staleness at K = 4: stage i's gradients land 3 - i
updates late). Figures are means over ``--seeds`` runs (split, order and initialisation).

Usage::

    python bench/xpipe_convergence.py --png bench/out/xpipe_convergence.png --json bench/out/xpipe_convergence.json
"""

from __future__ import annotations

import argparse
import os
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from fastpipe import Pipe  # noqa: E402
from fastpipe.bench.report import write_json  # noqa: E402

POLICIES = ("sync", "stale", "stash", "predict")
OPTIMIZERS = {
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    "sgd-momentum": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
}


def load_digits(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Standardised digits, split 70/30 into train and validation with a fixed permutation."""
    try:
        from sklearn.datasets import load_digits as sk_load
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SystemExit(
            "this benchmark needs scikit-learn: pip install scikit-learn (or pip install -e .[bench])"
        ) from exc
    digits = sk_load()
    x = torch.tensor(digits.data, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    cut = int(0.7 * len(x))
    mean, std = x[:cut].mean(0), x[:cut].std(0) + 1e-3
    x = (x - mean) / std
    return x[:cut], y[:cut], x[cut:], y[cut:]


def make_model(seed: int, hidden: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Sequential(nn.Linear(64, hidden), nn.ReLU()),
        nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()),
        nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()),
        nn.Linear(hidden, 10),
    )


def batches(x: Tensor, y: Tensor, batch: int, count: int, seed: int) -> list[tuple[Tensor, Tensor]]:
    """``count`` mini-batches, epochs reshuffled by a fixed generator (the same list for every policy)."""
    g = torch.Generator().manual_seed(seed)
    out: list[tuple[Tensor, Tensor]] = []
    while len(out) < count:
        perm = torch.randperm(len(x), generator=g)
        for i in range(0, len(x) - batch + 1, batch):
            idx = perm[i : i + batch]
            out.append((x[idx], y[idx]))
    return out[:count]


@torch.no_grad()
def evaluate(pipe: Pipe, x: Tensor, y: Tensor) -> tuple[float, float]:
    pipe.eval()
    out = pipe(x)
    pipe.train()
    return nn.functional.cross_entropy(out, y).item(), (out.argmax(1) == y).float().mean().item() * 100


def train(
    policy: str,
    optimizer: str,
    lr: float,
    data: list[tuple[Tensor, Tensor]],
    val: tuple[Tensor, Tensor],
    args: argparse.Namespace,
    seed: int,
) -> dict[str, Any]:
    pipe = Pipe(make_model(seed, args.hidden), balance=[1, 1, 1, 1], chunks=args.chunks, checkpoint="never")
    opt = OPTIMIZERS[optimizer](pipe.parameters(), lr)
    # Cosine decay to 0 over the run: the final validation figures are then not one noisy draw at a high lr.
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=len(data))
    run = pipe.fit(data, nn.CrossEntropyLoss(), opt, consistency=policy, scheduler=sched, window=args.window)
    curve: dict[str, list[float]] = {"step": [], "train_loss": [], "val_loss": [], "val_acc": []}
    recent: list[float] = []
    for loss in run:
        recent.append(loss.item())
        if run.steps % args.eval_every == 0:  # eval_every is a multiple of window: nothing in flight
            vl, va = evaluate(pipe, *val)
            curve["step"].append(run.steps)
            curve["train_loss"].append(sum(recent) / len(recent))
            curve["val_loss"].append(vl)
            curve["val_acc"].append(va)
            recent = []
    pipe.close()
    return {"curve": curve, "weight_copy_bytes": run.weight_copy_bytes}


def average(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean curves over seeds; final figures are the means of each seed's last evaluation."""
    keys = runs[0]["curve"]
    curve = {k: [sum(r["curve"][k][i] for r in runs) / len(runs) for i in range(len(keys[k]))] for k in keys}
    return {
        "curve": curve,
        "final_val_loss": curve["val_loss"][-1],
        "final_val_acc": curve["val_acc"][-1],
        "final_val_loss_per_seed": [r["curve"]["val_loss"][-1] for r in runs],
        "final_val_acc_per_seed": [r["curve"]["val_acc"][-1] for r in runs],
        "weight_copy_bytes": runs[0]["weight_copy_bytes"],
    }


def plot(results: dict[str, dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(2, len(names), figsize=(6 * len(names), 8), squeeze=False)
    for col, opt_name in enumerate(names):
        for policy, r in results[opt_name]["policies"].items():
            c = r["curve"]
            axes[0][col].plot(c["step"], c["val_loss"], label=policy)
            axes[1][col].plot(c["step"], c["val_acc"], label=policy)
        lr = results[opt_name]["lr"]
        axes[0][col].set_title(f"{opt_name}, lr={lr}: validation loss")
        axes[0][col].set_yscale("log")
        axes[1][col].set_title(f"{opt_name}, lr={lr}: validation accuracy (%)")
        axes[1][col].set_xlabel("mini-batches")
        for row in (0, 1):
            axes[row][col].legend()
            axes[row][col].grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minibatches", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=1, help="micro-batches per mini-batch M")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--window", type=int, default=25)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--adam-lr", type=float, default=1e-2)
    parser.add_argument("--sgd-lr", type=float, default=0.1)
    parser.add_argument("--seeds", type=int, default=3, help="runs per policy (data split, order and init)")
    parser.add_argument("--png", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.eval_every % args.window:
        parser.error("--eval-every must be a multiple of --window (evaluate where nothing is in flight)")
    torch.set_num_threads(1)
    splits = [load_digits(seed) for seed in range(args.seeds)]
    streams = [batches(xt, yt, args.batch, args.minibatches, seed) for seed, (xt, yt, _, _) in enumerate(splits)]
    results: dict[str, dict[str, Any]] = {}
    for opt_name, lr in (("adam", args.adam_lr), ("sgd-momentum", args.sgd_lr)):
        per_policy = {
            p: average(
                [
                    train(p, opt_name, lr, streams[seed], (splits[seed][2], splits[seed][3]), args, seed)
                    for seed in range(args.seeds)
                ]
            )
            for p in POLICIES
        }
        results[opt_name] = {"lr": lr, "policies": per_policy}
        sync = per_policy["sync"]
        print(
            f"\n{opt_name} lr={lr}, K=4, M={args.chunks}, batch {args.batch}, {args.minibatches} mini-batches, "
            f"mean of {args.seeds} seeds"
        )
        print(f"  {'policy':<8} {'val loss':>9} {'vs sync':>8} {'val acc':>8} {'vs sync':>8}")
        for p, r in per_policy.items():
            print(
                f"  {p:<8} {r['final_val_loss']:>9.4f} {r['final_val_loss'] / sync['final_val_loss'] - 1:>+8.1%} "
                f"{r['final_val_acc']:>7.2f}% {r['final_val_acc'] - sync['final_val_acc']:>+7.2f}"
            )
    if args.png:
        plot(results, args.png, f"digits, K=4 stages, M={args.chunks}, batch {args.batch}, mean of {args.seeds} seeds")
    write_json({"args": vars(args), "results": results}, args.json)


if __name__ == "__main__":
    main()
