"""scripts/planner_table.py --flagships (issue 42 item 5): the real-size table of docs/flagship-plans.md,
`hetermoe plan --cluster ... -- <the recipe's own flags>` per flagship, run here on two recipes of the
Megatron-LM core_v0.16.1 tree (MEGATRON_LM_DIR, else the checkout's .ci-work tree; skipped without)."""
import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tree() -> Path:
    for candidate in (os.environ.get("MEGATRON_LM_DIR"), ROOT / ".ci-work" / "Megatron-LM-core_v0.16.1"):
        if candidate and (Path(candidate) / "examples/post_training/modelopt/conf").is_dir():
            return Path(candidate)
    pytest.skip("no Megatron-LM core_v0.16.1 tree: set MEGATRON_LM_DIR to read the flagship recipes")


@pytest.fixture(scope="module")
def table():
    spec = importlib.util.spec_from_file_location("planner_table", ROOT / "scripts" / "planner_table.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["planner_table"] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["DeepSeek-V2-Lite", "Mixtral-8x22B"])
def test_flagship_rows_from_the_recipes_own_flags(table, name):
    tree = _tree()
    f = next(f for f in table.FLAGSHIPS if f.name == name)
    flags = table.flagship_flags(f, tree)
    recipe = table.recipe_flags(tree, f.recipe)  # every flag of the recipe is passed, values replaced where named
    assert [t for t in flags if t.startswith("--")][:len([t for t in recipe if t.startswith("--")])] == \
        [t for t in recipe if t.startswith("--") and t not in f.drop]
    assert flags[-2:] == ["--global-batch-size", str(f.global_batch)]
    t0 = time.perf_counter()
    row = table.flagship_row(f, tree)
    assert time.perf_counter() - t0 < 20  # the search, well under a few seconds of CPU (2 shared cores here)
    assert row["pick"].startswith(("zebra", "distep")), row
    for key in ("memory", "step", "megatron", "limits", "vs roofline", "bound"):
        assert row.get(key), (key, row)
    compute, network, roof = (float(x) for x in row["limits"].split(" / "))
    assert roof == max(compute, network) and 0 < float(row["vs roofline"]) <= 1
    assert float(row["step"]) >= roof


def test_flagships_markdown_and_refusals(table, capsys):
    tree = _tree()
    assert table.main(["--flagships", "--megatron-lm", str(tree), "--only", "DeepSeek-V2-Lite", "--markdown"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| model |") and out[2].startswith("| DeepSeek-V2-Lite |")
    assert table.main(["--flagships", "--megatron-lm", str(tree), "--only", "GPT-5"]) == 2
    assert "--only GPT-5: use names of" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="reads the recipes of a Megatron-LM core_v0.16.1 tree"):
        table.main(["--flagships", "--megatron-lm", str(ROOT / "configs")])
