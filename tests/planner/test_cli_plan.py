"""`hetermoe plan` in both modes, and its error messages."""
import json
import subprocess
import sys

import pytest

from megatron_hetermoe.plan.hetero_plan import HeteroPlan
from megatron_hetermoe.planner.cli_plan import _parser, main


def test_even_plan_file(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["--even", "--attention-ranks", "2", "--expert-ranks", "2", "--groups", "2", "--model", "tiny",
                 "--microbatches", "2", "--schedule", "zebra", "-o", str(out)]) == 0
    plan = HeteroPlan.load(out)
    plan.validate(world_size=8)
    assert plan.schedule == "zebra" and plan.num_microbatches == 2 and plan.gpu_types == ["cpu"] * 8


def test_even_plan_with_virtual_stages_from_megatron_flags(tmp_path, capsys):
    """The run's pipeline size, virtual pipeline size and batch make the plan's P, V and R (issue 42:
    they were hetermoe plan's own flags, and the run refused the mismatch)."""
    out = tmp_path / "p.json"
    run = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--num-experts", "4",
           "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
           "--micro-batch-size", "1", "--global-batch-size", "4"]
    assert main(["--even", "--attention-ranks", "1", "--expert-ranks", "1", "-o", str(out), "--", *run]) == 0
    plan = HeteroPlan.load(out)
    assert (plan.pipeline_stages, plan.virtual_stages, plan.num_microbatches) == (2, 2, 4)
    assert plan.stage_model_layers(0) == [0, 2]
    # hetermoe plan's own value, where it agrees with the run's, is accepted; where not, refused by name
    assert main(["--even", "--attention-ranks", "1", "--expert-ranks", "1", "--pipeline-stages", "2",
                 "--virtual-stages", "2", "--microbatches", "4", "-o", str(out), "--", *run]) == 0
    assert main(["--even", "--attention-ranks", "1", "--expert-ranks", "1", "--pipeline-stages", "4",
                 "-o", str(out), "--", *run]) == 2
    assert ("--pipeline-stages 4 and the run's --pipeline-model-parallel-size 2 (after --; Megatron's default where "
            "the flag is absent) disagree" in capsys.readouterr().err)
    # zebra takes the run's virtual stages too (docs/virtual-stages.md); without pipeline stages refused by name
    assert main(["--even", "--attention-ranks", "1", "--expert-ranks", "1", "--schedule", "zebra", "-o", str(out),
                 "--", *run]) == 0
    assert (HeteroPlan.load(out).schedule, HeteroPlan.load(out).virtual_stages) == ("zebra", 2)
    assert main(["--even", "--attention-ranks", "1", "--expert-ranks", "1", "--virtual-stages", "2", "--schedule",
                 "zebra", "--model", "tiny"]) == 2
    assert "virtual_stages=2 needs pipeline stages (it has pipeline_stages=1)" in capsys.readouterr().err


def test_even_plan_flags_are_refused_in_a_search(capsys):
    """A search picks M, N, G, R, the schedule, the waves and the GPUs itself: --zebra-waves or
    --virtual-stages given to it would be ignored, so they are refused by name."""
    assert main(["--cluster", "o1", "--model", "d1", "--seq-len", "4096", "--global-batch", "48",
                 "--zebra-waves", "2", "--virtual-stages", "2"]) == 2
    assert ("--zebra-waves, --virtual-stages: only with --even (a search, --cluster, chooses the layout itself)"
            in capsys.readouterr().err)


# Each flag of the "even plan" group with a value other than its default.
EVERY_EVEN_FLAG = [("--attention-ranks", "2"), ("--expert-ranks", "2"), ("--groups", "2"), ("--microbatches", "2"),
                   ("--schedule", "zebra"), ("--zebra-waves", "2"), ("--zebra-wave-order", "1f1b"),
                   ("--virtual-stages", "2"), ("--attention-gpu", "h100"), ("--expert-gpu", "a40")]


@pytest.mark.parametrize("flag,value", EVERY_EVEN_FLAG)
def test_every_even_plan_flag_is_refused_in_a_search(capsys, flag, value):
    """The refusal covers the whole "even plan" group (the parser's own record of it), each flag by name."""
    assert sorted("--" + d.replace("_", "-") for d in _parser().even_only) == sorted(
        f for f, _ in EVERY_EVEN_FLAG)
    assert main(["--cluster", "o1", "--model", "d1", "--seq-len", "4096", "--global-batch", "48", flag, value]) == 2
    assert f"{flag}: only with --even" in capsys.readouterr().err


def test_even_rejects_unknown_gpu(capsys):
    assert main(["--even", "--attention-ranks", "1", "--expert-ranks", "1", "--model", "tiny",
                 "--attention-gpu", "B200"]) == 2
    assert "B200" in capsys.readouterr().err


def test_search_json_has_step_time_and_tokens_per_s(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["--cluster", "o1", "--model", "d1", "--seq-len", "4096", "--global-batch", "48", "--json",
                 "-o", str(out)]) == 0
    d = json.loads(capsys.readouterr().out)
    for name in ("HeterMoE (planner's pick)", "EP", "EP (Ideal)", "DistEP", "Hetero PP", "Physical limit"):
        assert d["strategies"][name]["step_time_s"] > 0 and d["strategies"][name]["tokens_per_s"] > 0
    HeteroPlan.load(out).validate(world_size=12)


def test_search_table_and_missing_args(capsys):
    assert main(["--cluster", "c2", "--model", "d2", "--seq-len", "4096", "--global-batch", "16"]) == 0
    table = capsys.readouterr().out
    assert "Physical limit" in table and "util T4" in table
    assert main(["--cluster", "o1", "--model", "d1"]) == 2
    assert "--seq-len" in capsys.readouterr().err


def test_console_script_dispatch():
    r = subprocess.run([sys.executable, "-m", "megatron_hetermoe.cli", "plan", "--help"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "--global-batch" in r.stdout


def test_table_names_a_layout_that_no_longer_fits(capsys):
    # O1, D1, 20K, 96 sequences: V100s cannot hold 32 experts next to zebra's live tokens (see
    # test_smoothness's hand check), so zebra without Asym-EA, with expert ranks keeping their
    # inputs, has to leave the A40-attention layout
    assert main(["--cluster", "o1", "--model", "d1", "--seq-len", "20480", "--global-batch", "96",
                 "--expert-recompute", "keep-inputs"]) == 0
    out = capsys.readouterr().out
    notes = [ln for ln in out.splitlines() if ln.startswith("note:")]
    assert any("Zebra (no Asym-EA)" in ln and "attention on 6 A40" in ln and "must hold 32 experts" in ln
               and "'keep-inputs'" in ln for ln in notes), notes
    assert "expert recompute: keep-inputs" in out
    # auto: the expert ranks keep nothing there instead (resend-inputs), and the layout fits
    assert main(["--cluster", "o1", "--model", "d1", "--seq-len", "20480", "--global-batch", "96"]) == 0
    out = capsys.readouterr().out
    assert not any("Zebra (no Asym-EA) cannot use attention on 6 A40" in ln for ln in out.splitlines()), out
