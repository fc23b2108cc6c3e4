"""The memory plan (`gqaify uptrain --plan CONFIG`): its held bytes against the models' own tensors, counted
independently, and the command (benchmarks/memory_plan.py checks the totals against measured peaks)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from gqaify.entry.cli import main
from gqaify.packaged import RECIPES, find
from gqaify.uptrain.plan import Launch, plan
from gqaify.uptrain.settings import parse
from helpers import one_line
from helpers import uptrain_args as args


def shard_bytes(tensors, n: int, dtype=None) -> int:
    """The bytes of the first of n processes' share of each tensor as FSDP2 shards it (`Shard(0)`: the first piece
    `torch.chunk` cuts on the first dimension), in `dtype` or the tensor's own: the tensors themselves, cut."""
    return sum(torch.chunk(t.detach(), n, dim=0)[0].to(dtype or t.dtype).nbytes for t in tensors)


@pytest.mark.parametrize("processes", [1, 2, 3])
@pytest.mark.parametrize("trainable", ["all", "attention"])
def test_held_bytes_are_the_models_own_tensors(tiny, tmp_path, processes, trainable):
    settings = parse(args(tiny, tmp_path / "run", "--distill_from", str(tiny["parent"]), "--trainable", trainable))
    launch = Launch(processes, processes > 1, "no")
    found = plan(settings, launch)
    student = AutoModelForCausalLM.from_pretrained(tiny["converted"], dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(tiny["parent"])
    weights = list(dict(student.named_parameters()).values())  # tied embeddings once
    trained = [p for n, p in student.named_parameters() if trainable == "all" or ".self_attn." in n]
    assert found.student == shard_bytes(weights, processes, torch.float32)
    assert found.gradients == shard_bytes(trained, processes, torch.float32)
    assert found.optimizer == 2 * found.gradients
    assert found.teacher == shard_bytes(list(teacher.parameters()), processes)
    assert found.buckets == 0 and (found.gathered > 0) == (processes > 1)
    assert found.total == (
        found.student + found.optimizer + found.teacher + found.gathered + max(found.activations, found.update)
    )


def test_ddp_holds_whole_copies_and_its_buckets(tiny, tmp_path):
    settings = parse(args(tiny, tmp_path / "run"))
    one, ddp = plan(settings, Launch(1, False, "no")), plan(settings, Launch(4, False, "no"))
    assert ddp.student == one.student and ddp.gradients == one.gradients and ddp.teacher == 0
    assert ddp.buckets == ddp.gradients and one.buckets == 0


def test_lora_trains_only_its_adapters(tiny, tmp_path):
    from gqaify.uptrain.lora import with_adapters

    settings = parse(args(tiny, tmp_path / "run", "--trainable", "lora", "--lora_rank", "4"))
    adapted = with_adapters(AutoModelForCausalLM.from_pretrained(tiny["converted"], dtype=torch.float32), 4, 16)
    adapters = [p for p in adapted.parameters() if p.requires_grad]
    assert plan(settings, Launch(1, False, "no")).gradients == sum(p.numel() * 4 for p in adapters)


def test_whole_teacher_is_held_whole_under_fsdp(tiny, tmp_path):
    teaching = ["--distill_from", str(tiny["parent"])]
    sharded = plan(parse(args(tiny, tmp_path / "a", *teaching)), Launch(2, True, "no"))
    whole = plan(parse(args(tiny, tmp_path / "b", *teaching, "--no_shard_teacher")), Launch(2, True, "no"))
    teacher = AutoModelForCausalLM.from_pretrained(tiny["parent"])
    assert whole.teacher == sum(p.numel() * p.element_size() for p in teacher.parameters())
    assert sharded.teacher == shard_bytes(list(teacher.parameters()), 2)
    assert whole.gathered < sharded.gathered  # a whole teacher gathers nothing


def test_the_activations_grow_with_the_micro_batch(tiny, tmp_path):
    small = plan(parse(args(tiny, tmp_path / "a", "--micro_batch_size", "1")), Launch(1, False, "no"))
    large = plan(parse(args(tiny, tmp_path / "b", "--micro_batch_size", "8")), Launch(1, False, "no"))
    assert 0 < small.activations < large.activations


def test_packaged_accelerate_configs_read_as_launches():
    assert Launch.read(find("accelerate/fsdp")) == Launch(8, True, "bf16")
    assert Launch.read(find("accelerate/multi-gpu")) == Launch(8, False, "bf16")
    assert Launch.read(find("accelerate/cpu")) == Launch(1, False, "no")


def test_plan_prints_the_table_and_writes_nothing(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["uptrain", *args(tiny, out), "--plan", "accelerate/fsdp"]) == 0
    printed = capsys.readouterr().out
    assert "memory per process: 8 process(es), FSDP2, sharded, precision bf16" in printed
    assert "student weights (float32)" in printed and "total" in printed
    assert not out.exists()


def test_plan_is_an_option_of_the_settings_parser(tiny, tmp_path, capsys):
    """--plan was taken out of the arguments by hand: --plan=CONFIG was an unknown option and --help omitted it."""
    out = tmp_path / "run"
    assert main(["uptrain", *args(tiny, out), "--plan", "accelerate/fsdp"]) == 0
    spaced = capsys.readouterr().out
    assert main(["uptrain", *args(tiny, out), "--plan=accelerate/fsdp"]) == 0
    assert capsys.readouterr().out == spaced and not out.exists()
    assert main(["uptrain", "--help"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "--plan [CONFIG] print the bytes each process holds at a step's peak under this accelerate config" in shown


@pytest.mark.parametrize("plan", [["--plan", "accelerate/fsdp"], ["--plan=accelerate/fsdp"]])
def test_the_python_parse_refuses_plan(tiny, tmp_path, plan):
    """gqaify.uptrain.parse took --plan and dropped it: run(parse(argv)) trained where a memory plan was asked."""
    from gqaify.errors import UserError
    from gqaify.uptrain.settings import parse_command_line

    out = tmp_path / "run"
    with pytest.raises(UserError) as refused:
        parse(args(tiny, out, *plan))
    said = str(refused.value)
    assert "\n" not in said and said.startswith("--plan asks for a memory plan")
    assert "parse_command_line" in said and "gqaify uptrain ... --plan CONFIG" in said
    settings, config = parse_command_line(args(tiny, out, *plan), "gqaify uptrain")
    assert config == find("accelerate/fsdp") and settings == parse(args(tiny, out))
    assert not out.exists()


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ([], "--plan needs the accelerate config of the launch"),
        (["--lr", "1e-4"], "--plan needs the accelerate config of the launch"),
        (["no-such-config"], "--plan no-such-config: no such accelerate config"),
        (["nowhere", "--micro_batch_size", "100000000"], "--plan nowhere: no such accelerate config"),  # said first
    ],
)
def test_plan_without_a_config_is_refused(tiny, tmp_path, capsys, given, said):
    assert main(["uptrain", *args(tiny, tmp_path / "run"), "--plan", *given]) == 2
    assert said in one_line(capsys.readouterr().err)


def test_plan_of_a_file_that_is_no_accelerate_config_is_refused(tiny, tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("lr: 1\n")
    assert main(["uptrain", *args(tiny, tmp_path / "run"), "--plan", str(config)]) == 2
    assert "is not an accelerate config (no distributed_type)" in one_line(capsys.readouterr().err)


def test_plan_of_an_accelerate_config_without_its_distributed_type_names_what_to_add(tiny, tmp_path, capsys):
    """A packaged config copied and its distributed_type deleted stops `accelerate launch` in accelerate's own
    traceback, before gqaify runs; --plan, which checks a config before any launch, names the key to add."""
    config = tmp_path / "cpu.yaml"
    kept = [line for line in (RECIPES / "accelerate" / "cpu.yaml").read_text().splitlines()
            if not line.startswith("distributed_type")]  # fmt: skip
    config.write_text("\n".join(kept) + "\n")
    assert main(["uptrain", *args(tiny, tmp_path / "run"), "--plan", str(config)]) == 2
    assert one_line(capsys.readouterr().err).endswith(
        f"--plan {config} has no distributed_type, which accelerate launch requires of a config file; add "
        "distributed_type: 'NO' (one process), MULTI_GPU (DDP) or FSDP"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ("num_processes: eight", "num_processes must be a positive whole number, got 'eight'"),
        ("num_processes: -4", "num_processes must be a positive whole number, got -4"),
        ("num_processes: 0", "num_processes must be a positive whole number, got 0"),
        ("num_processes: 8.5", "num_processes must be a positive whole number, got 8.5"),
        ("distributed_type: DEEPSPEED", "not distributed_type DEEPSPEED; give a DDP or FSDP config"),
        ("distributed_type: XLA", "not distributed_type XLA"),
    ],
)
def test_plan_of_a_launch_it_cannot_plan_is_refused(tiny, tmp_path, capsys, line, said):
    """num_processes was read with int() (a traceback for 'eight', 8.5 planned as 8, 0 as 1, -4 planned) and a
    DeepSpeed config was planned as DDP without a word."""
    key = line.split(":")[0]
    base = {"distributed_type": "MULTI_GPU", "num_processes": "2", "mixed_precision": "bf16"}
    config = tmp_path / "c.yaml"
    config.write_text("".join(f"{k}: {v}\n" for k, v in base.items() if k != key) + line + "\n")
    assert main(["uptrain", *args(tiny, tmp_path / "run"), "--plan", str(config)]) == 2
    assert said in one_line(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


def test_ddp_on_cpus_and_a_config_without_num_processes_are_planned(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("distributed_type: MULTI_CPU\n")
    assert Launch.read(config) == Launch(1, False, "no")


@pytest.mark.parametrize(
    ("batch", "said"),
    [
        ("100000000", "the 1,280 training tokens are fewer than one optimizer step of 3,200,000,000 "),
        ("30", "the 1,280 training tokens are fewer than one optimizer step of 7,680 "),  # of the launch's 8 processes
    ],
)
def test_a_batch_the_run_refuses_is_refused_before_planning(tiny, tmp_path, capsys, monkeypatch, batch, said):
    """A micro-batch of 10^8 was still being planned after 60 s, where the run refuses it at once: no model is built
    and no step's activations are counted (a refusal that needs the launch's processes is the plan's, made from the
    configs alone)."""
    import gqaify.uptrain.plan as plan_module

    planned = []
    monkeypatch.setattr(plan_module, "_trainable_model", lambda *given: planned.append("the model"))
    monkeypatch.setattr(plan_module, "_activations", lambda *given: planned.append("the activations"))
    argv = ["uptrain", *args(tiny, tmp_path / "run", "--micro_batch_size", batch), "--plan", "accelerate/fsdp"]
    assert main(argv) == 2
    assert said in one_line(capsys.readouterr().err) and planned == []
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without a GPU is told")
def test_a_plan_of_several_gpu_processes_says_what_stops_them_on_a_machine_without_a_gpu(tiny, tmp_path, monkeypatch):
    """Launched on a CPU machine without ACCELERATE_USE_CPU, each process refused and torch's launcher printed its
    ChildFailedError traceback after gqaify's line; the plan made here says so first, and how to launch here."""
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    settings = parse(args(tiny, tmp_path / "run"))
    multi = plan(settings, Launch.read(find("accelerate/multi-gpu"))).table()
    assert multi.splitlines()[-1] == (
        "note: this machine has no GPU: launched here, the 8 processes would join no group; launch with "
        "ACCELERATE_USE_CPU=1 (or plan here what a GPU machine will run)"
    )
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    assert "note:" not in plan(settings, Launch.read(find("accelerate/multi-gpu"))).table()
    on_cpus = tmp_path / "cpus.yaml"
    on_cpus.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\n")
    monkeypatch.delenv("ACCELERATE_USE_CPU")
    assert "note:" not in plan(settings, Launch.read(on_cpus)).table()
