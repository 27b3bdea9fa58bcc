"""Print scripts/demo.sh's closing summary from the --summary-json files of its training runs.

Usage: python scripts/demo_summary.py DIR, where DIR holds pytorch-2.json and keras-2.json (2 ranks) and
pytorch-1.json and keras-1.json (1 process), as examples/pytorch_train.py and examples/keras_train.py write them.
"""

from __future__ import annotations

import json
import math
import os
import sys
import textwrap
from pathlib import Path


def load(directory: Path, name: str) -> dict:
    return json.loads((directory / f"{name}.json").read_text())


def main() -> None:
    directory = Path(sys.argv[1])
    rows = [("PyTorch", "pytorch"), ("Keras", "keras")]
    runs = {(name, ranks): load(directory, f"{name}-{ranks}") for _, name in rows for ranks in (1, 2)}
    first = runs["pytorch", 2]
    for (name, ranks), run in runs.items():  # the comparison is fair only if every run steps alike
        if run["global_batch_size"] != first["global_batch_size"] or not math.isclose(
            run["learning_rate"], first["learning_rate"]
        ):
            sys.exit(f"{name} on {ranks} rank(s) trained with another global batch or learning rate: {run}")
    print(f"== Summary: a small CNN on scikit-learn's 8x8 digits, {first['epochs']} epochs")
    print(f"{'':9}{'2 ranks (hvdplusrun -np 2)':40}1 process (python, no launcher)")
    for label, name in rows:
        cells = [
            f"test accuracy {run['test_accuracy']:.3f}, {run['images_per_second']:6.0f} images/s"
            for run in (runs[name, 2], runs[name, 1])
        ]
        print(f"{label:9}{cells[0]:40}{cells[1]}")
    batch = first["global_batch_size"]
    notes = (
        f"Both sides train with {batch} images per step at learning rate {first['learning_rate']:g} (2 ranks x "
        f"{batch // 2}, or 1 process x {batch}), so their accuracies compare: they differ by the order of the data, "
        f"by PyTorch's batch norm over {batch // 2} or {batch} images, and by float rounding. images/s counts the "
        "training images of all ranks per second from epoch 2 on (the first warms up); both sides ran on the same "
        f"{os.cpu_count()} CPU cores, so it shows what splitting the work costs or saves here, not what more "
        "hardware would bring."
    )
    print(textwrap.fill(notes, width=110))


if __name__ == "__main__":
    main()
