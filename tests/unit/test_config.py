"""Config composition, overrides and every validation rule (pure: no process starts)."""

import dataclasses

import pytest

from ppctl.config import ConfigError, padded_vocab_size
from ppctl.resolve import compose_config, validate


def composed(*overrides):
    return compose_config(list(overrides))


def test_defaults_compose_and_validate():
    config = composed()
    sizes = validate(config)
    assert config.model.name == "gpt_tiny" and config.schedule.name == "1f1b"
    assert sizes.world_size == config.parallel.tp * config.parallel.pp * config.parallel.dp * config.parallel.cp
    padded = sizes.model.padded_vocab_size
    assert padded % 64 == 0 and padded >= config.model.vocab_size


def test_group_and_key_overrides():
    config = composed("model=gpt_small", "schedule=gpipe", "parallel.tp=2", "trainer.seed=7", "data=synthetic")
    assert config.model.num_layers == 12 and config.schedule.name == "gpipe"
    assert config.parallel.tp == 2 and config.trainer.seed == 7 and config.data.source == "synthetic"


def test_every_schedule_has_a_config_file():
    for name in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipe", "dualpipev"):
        assert composed(f"schedule={name}").schedule.name == name


@pytest.mark.parametrize("override, fragment", [
    ("parallel.tpp=2", "tpp"),
    ("parallel.tp=abc", "parallel.tp"),
    ("trainer.seed=1.5", "trainer.seed"),
    ("schedule=nope", "available: 1f1b"),
    ("model=gpt_huge", "gpt_small, gpt_tiny"),
    ("nonsense", "nonsense"),
])
def test_bad_overrides_refused_in_one_line(override, fragment):
    with pytest.raises(ConfigError) as error:
        composed(override)
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_user_config_dir_keeps_package_groups(tmp_path):
    (tmp_path / "mine.yaml").write_text("defaults:\n  - config\n  - _self_\ntrainer:\n  max_steps: 7\n")
    config = compose_config(["parallel=single"], tmp_path, "mine")
    assert config.trainer.max_steps == 7 and config.parallel.pp == 1


# Each rule: overrides that break it, and a fragment of the one-line message that names it.
RULES = [
    (["parallel.tp=0"], "parallel.tp=0 must be a positive integer"),
    (["trainer.micro_batch_size=0"], "trainer.micro_batch_size=0 must be a positive"),
    (["model.hidden_size=0"], "model.hidden_size=0 must be a positive"),
    (["parallel.order=tp-dp-pp"], "parallel.order"),
    (["model.num_layers=6", "parallel.pp=4"], "model.num_layers=6 must be divisible by the number of pipeline stages 4"),
    (["schedule=interleaved_1f1b", "parallel.pp=2", "parallel.vpp=3", "model.num_layers=4"],
     "must be divisible by the number of pipeline stages 6"),
    (["parallel.pipeline_layout=Et|ttL"], "parallel.pipeline_layout places 3 transformer layers but model.num_layers=4"),
    (["parallel.tp=3", "model.num_heads=4"], "model.num_heads=4 must be divisible by parallel.tp=3"),
    (["model.hidden_size=66"], "model.hidden_size=66 must be divisible by model.num_heads=4"),
    (["parallel.cp=2", "trainer.seq_length=30"], "trainer.seq_length=30 must be divisible by 2 * parallel.cp = 4"),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "trainer.seq_length=31", "model.max_seq_length=64"],
     "trainer.seq_length=31 must be divisible by parallel.cp * parallel.tp = 2 with sequence parallelism"),
    # seq 36 splits into 2*cp = 4 chunks, but a CP rank's 18 tokens do not split over tp=4.
    (["parallel.tp=4", "parallel.cp=2", "parallel.sequence_parallel=true", "trainer.seq_length=36"],
     "trainer.seq_length=36 must be divisible by parallel.cp * parallel.tp = 8 with sequence parallelism"),
    (["parallel.cp_comm=ulysses"], "parallel.cp_comm='ulysses' must be one of allgather, ring, a2a"),
    (["parallel.tp=2", "parallel.cp=4", "parallel.cp_comm=a2a", "model.num_heads=4"],
     "parallel.cp_comm=a2a splits heads over tp*cp: model.num_heads=4 must be divisible by parallel.tp * parallel.cp = 8"),
    (["trainer.global_batch_size=6", "trainer.micro_batch_size=4"],
     "trainer.global_batch_size=6 must be divisible by trainer.micro_batch_size * parallel.dp = 4"),
    (["parallel.dp=2", "trainer.global_batch_size=6", "trainer.micro_batch_size=2"],
     "must be divisible by trainer.micro_batch_size * parallel.dp = 4"),
    (["parallel.vpp=2"], "parallel.vpp=2 needs a schedule with several chunks per rank"),
    (["launcher.nproc_per_node=3"], "launcher.nproc_per_node * launcher.nnodes = 3 must equal the world size"),
    (["launcher.nnodes=2", "launcher.nproc_per_node=2"], "must equal the world size"),
    (["launcher.nnodes=2", "launcher.nproc_per_node=1"], "launcher.nnodes > 1 needs launcher.rdzv_endpoint"),
    (["trainer.seq_length=512"], "trainer.seq_length=512 must not exceed model.max_seq_length=256"),
    (["trainer.precision=fp8"], "trainer.precision='fp8' must be one of"),
    (["model.position_embedding=alibi"], "model.position_embedding='alibi' must be one of"),
    (["model.activation=relu"], "model.activation='relu' must be one of gelu, gelu_tanh"),
    (["model=llama_tiny", "model.activation=relu"],
     "model.activation=relu is read by model.family=gpt (and gpt_neox) only; this model is model.family=llama "
     "(drop the key, or set model.family=gpt)"),
    (["model=llama_tiny", "model.activation=gelu_tanh"],
     "model.activation=gelu_tanh is read by model.family=gpt (and gpt_neox) only; this model is model.family=llama "
     "(drop the key, or set model.family=gpt)"),
    (["data=text"], "data.source=text needs data.path"),
    (["data=text", "data.path=/nonexistent/file.txt"], "data.path=/nonexistent/file.txt: no such file, folder or glob"),
    (["launcher.backend=mpi"], "launcher.backend='mpi' must be one of"),
    (["launcher.inject_fault=boom"], "launcher.inject_fault='boom' must look like RANK:raise or RANK:kill"),
    (["launcher.inject_fault=1:kill@x"], "optionally @STEP (1:kill@5)"),
    (["launcher.inject_fault=99:kill"], "launcher.inject_fault='99:kill' names rank 99, but the job has 2 rank(s) "
                                        "(0..1): the fault would never fire"),
    (["launcher.inject_fault=0:kill@999", "trainer.max_steps=10"],
     "fires after step 999, outside this run's steps 1..trainer.max_steps=10"),
    (["launcher.inject_fault=0:raise@0"], "fires after step 0, outside this run's steps"),
    (["launcher.max_restarts=-1"], "launcher.max_restarts=-1 must be >= 0"),
    (["launcher.kind=pbs"], "launcher.kind='pbs' must be one of local, slurm"),
    (["launcher=slurm", "launcher.slurm.nodes=2", "launcher.nnodes=4", "launcher.nproc_per_node=2",
      "parallel=tp2_pp2_dp2"], "launcher.slurm.nodes=2 and launcher.nnodes=4 disagree"),
    (["launcher=slurm", "launcher.slurm.time=1h"], "launcher.slurm.time='1h' must be a Slurm time"),
    (["launcher=slurm", "launcher.slurm.cpus_per_task=0"], "launcher.slurm.cpus_per_task=0 must be a positive"),
    (["launcher=slurm", "launcher.slurm.gpus_per_node=-1"], "launcher.slurm.gpus_per_node=-1 must be >= 0"),
    (["launcher=slurm", "trainer.checkpoints=false"], "launcher.slurm.requeue=true resumes a stopped job"),
    (["launcher=slurm", "launcher.slurm.extra_args=[exclusive]"], "'exclusive' must be one sbatch option"),
    (["trainer.auto_resume=true"], "trainer.auto_resume=true continues the run directory trainer.out_dir: set it"),
    (["trainer.auto_resume=true", "trainer.out_dir=/tmp/r", "trainer.overwrite=true"], "choose one"),
    (["optimizer.lr=-1"], "optimizer.lr=-1.0 must be positive"),
    (["trainer.seed=-3"], "trainer.seed=-3 must be >= 0"),
    (["optimizer.lr_decay_style=step"], "optimizer.lr_decay_style='step' must be one of constant, linear, cosine"),
    (["optimizer.warmup_steps=-1"], "optimizer.warmup_steps=-1 must be >= 0"),
    (["optimizer.min_lr=-0.1"], "optimizer.min_lr=-0.1 must be >= 0 and <= optimizer.lr=0.003"),
    (["optimizer.min_lr=0.01"], "optimizer.min_lr=0.01 must be >= 0 and <= optimizer.lr=0.003"),
    (["optimizer.warmup_steps=10", "optimizer.decay_steps=10"],
     "optimizer.decay_steps=10 must be greater than optimizer.warmup_steps=10"),
    (["optimizer.warmup_steps=200"],
     "optimizer.warmup_steps=200 must be less than optimizer.decay_steps (default trainer.max_steps=200)"),
    # Issue 54: values that trained nothing (every step skipped, exit 0), or failed a worker later.
    (["model.position_embedding=rope", "model.rope_theta=0"], "model.rope_theta=0.0 must be positive"),
    (["model=llama_tiny", "model.rope_theta=-10000"], "model.rope_theta=-10000.0 must be positive"),
    (["model=llama_tiny", "model.rope_theta=inf"], "model.rope_theta=inf must be a finite number"),
    (["model.position_embedding=rope", "model.rope_theta=nan"], "model.rope_theta=nan must be a finite number"),
    (["model.norm_epsilon=-1e-5"], "model.norm_epsilon=-1e-05 must be positive"),
    (["model.init_std=-0.02"], "model.init_std=-0.02 must be >= 0"),
    (["optimizer.beta2=1.5"], "optimizer.beta2=1.5 must be >= 0 and < 1"),
    (["optimizer.eps=-1e-8"], "optimizer.eps=-1e-08 must be >= 0"),
    (["model=llama_tiny", "model.num_kv_heads=0"], "model.num_kv_heads=0 must be a positive integer, or unset (null)"),
    (["model=llama_tiny", "model.head_dim=0"], "model.head_dim=0 must be a positive integer, or unset (null)"),
    (["model=llama_tiny", "model.head_dim=-16"], "model.head_dim=-16 must be a positive integer, or unset (null)"),
    # Keys the model would not read.
    (["model=llama_tiny", "model.rope_low_freq_factor=2"],
     "model.rope_low_freq_factor=2.0 is read only with model.rope_scaling_factor, which is "
     "unset: set it too, or drop the key"),
    (["model=llama_tiny", "model.rope_original_max_position=4096"],
     "model.rope_original_max_position=4096 is read only with model.rope_scaling_factor"),
    (["model.rope_high_freq_factor=8"], "model.rope_high_freq_factor=8.0 is read by model.family=llama (and gemma, "),
    (["model.rope_theta=500000"],
     "model.rope_theta=500000.0 is read only with model.position_embedding=rope; this model has learned positions "
     "(drop the key, or set model.position_embedding=rope)"),
    (["model=llama_tiny", "model.rope_scaling_factor=8", "model.rope_original_max_position=0"],
     "model.rope_original_max_position=0 must be a positive integer"),
]


def test_every_float_setting_refuses_a_value_that_is_not_finite():
    """Whatever the setting (each of them, found in the schema by type): one line naming it, at validation (set on
    a composed config: the overrides above show that Hydra reads inf and nan as floats)."""
    import copy
    import functools

    from ppctl.resolve.validate import float_settings

    base = composed()
    names = [name for name, _value in float_settings(base, "")]
    assert {"model.rope_theta", "model.moe.capacity_factor", "optimizer.lr", "model.moe.z_loss_coeff"} <= set(names)
    for name in names:
        for value in (float("inf"), float("-inf"), float("nan")):
            config = copy.deepcopy(base)
            *sections, key = name.split(".")
            setattr(functools.reduce(getattr, sections, config), key, value)
            with pytest.raises(ConfigError) as error:
                validate(config, prove_schedule=False, data=False)
            assert str(error.value) == f"{name}={value} must be a finite number", name


def test_a_llama_with_its_settings_unset_reads_the_heads_and_their_width():
    from ppctl.model.llama.heads import head_dim_of, kv_heads_of

    model = composed("model=llama_tiny", "model.num_kv_heads=null").model
    assert (head_dim_of(model), kv_heads_of(model)) == (model.hidden_size // model.num_heads, model.num_heads)


@pytest.mark.parametrize("overrides, fragment", RULES)
def test_validation_rule_refuses_with_one_line(overrides, fragment):
    with pytest.raises(ConfigError) as error:
        validate(composed(*overrides))
    message = str(error.value)
    assert fragment in message, message
    assert "\n" not in message


def test_per_schedule_microbatch_rule_is_enforced(monkeypatch):
    import dataclasses

    from ppctl.pipeline import schedules

    def refuse_odd(pp, vpp, num_microbatches):
        return f"needs an even number of microbatches, got {num_microbatches}" if num_microbatches % 2 else None

    strict = dataclasses.replace(schedules.SCHEDULE_SPECS["1f1b"], microbatch_error=refuse_odd)
    monkeypatch.setitem(schedules.SCHEDULE_SPECS, "1f1b", strict)
    with pytest.raises(ConfigError, match="schedule 1f1b: needs an even number of microbatches, got 3"):
        validate(composed("trainer.global_batch_size=6", "trainer.micro_batch_size=2"))
    validate(composed("trainer.global_batch_size=8", "trainer.micro_batch_size=2"))


def test_explicit_pipeline_layout_accepted():
    config = composed("parallel.pp=2", "model.num_layers=5", "parallel.pipeline_layout=Ettt|ttL")
    validate(config)


def test_every_command_validates_batch_rules_even_at_scale():
    scale = ["parallel.tp=8", "parallel.pp=16", "parallel.dp=128", "model.num_layers=32"]
    with pytest.raises(ConfigError, match="model.num_heads=4 must be divisible by parallel.tp=8"):
        validate(composed(*scale))
    with pytest.raises(ConfigError, match="global_batch_size=8 must be divisible"):
        validate(composed(*scale, "model.num_heads=8"))
    config = composed(*scale, "model.num_heads=8", "trainer.global_batch_size=1024")
    assert validate(config).world_size == 16384


def test_v_and_bidirectional_schedules_take_two_chunks_unless_told_otherwise():
    for name in ("zbv", "dualpipe", "dualpipev"):
        config = composed(f"schedule={name}", "parallel.pp=2")  # the commands, as typed
        assert config.parallel.vpp == 2
        validate(config)
    with pytest.raises(ConfigError, match=r"parallel.vpp=1: schedule zbv places exactly 2 chunks .* set parallel.vpp=2"):
        validate(composed("schedule=zbv", "parallel.pp=2", "parallel.vpp=1"))
    assert composed("schedule=interleaved_1f1b").parallel.vpp == 1


def test_dualpipe_needs_an_even_pp_and_enough_microbatches():
    with pytest.raises(ConfigError, match="schedule dualpipe: .*even"):
        validate(composed("schedule=dualpipe", "parallel.pp=3", "model.num_layers=6", "trainer.global_batch_size=48"))
    with pytest.raises(ConfigError, match=r"schedule dualpipe: .*2\*pp"):
        validate(composed("schedule=dualpipe", "parallel.pp=4", "trainer.global_batch_size=6",
                          "trainer.micro_batch_size=1"))
    with pytest.raises(ConfigError, match=r"schedule dualpipev: .*2\*pp"):
        validate(composed("schedule=dualpipev", "parallel.pp=4", "trainer.global_batch_size=4",
                          "trainer.micro_batch_size=1", "model.num_layers=8"))
    # DualPipe splits the model into pp model stages (two copies of each), not 2*pp.
    with pytest.raises(ConfigError, match=r"num_layers=6 must be divisible .* 4 \(pp \* vpp; pp with dualpipe"):
        validate(composed("schedule=dualpipe", "parallel.pp=4", "model.num_layers=6", "trainer.global_batch_size=16",
                          "trainer.micro_batch_size=1"))


def test_validation_runs_the_schedule_checker(monkeypatch):
    from ppctl.pipeline import schedules
    from ppctl.pipeline.schedules.base import Schedule

    def broken(pp, vpp, num_microbatches):  # rank 0 forgets the backward of microbatch 0
        good = schedules.build_schedule("gpipe", pp, vpp, num_microbatches)
        actions = (good.actions[0][:-num_microbatches] + good.actions[0][-num_microbatches + 1:],) + good.actions[1:]
        return Schedule("gpipe", pp, 1, num_microbatches, good.placement, actions)

    spec = dataclasses.replace(schedules.SCHEDULE_SPECS["gpipe"], generate=broken)
    monkeypatch.setitem(schedules.SCHEDULE_SPECS, "broken", dataclasses.replace(spec, name="broken"))
    with pytest.raises(ConfigError, match="schedule broken: .*stage 0 .*microbatch 0 has 0 backwards"):
        validate(composed("schedule.name=broken", "parallel.pp=2"))


def test_vocab_padding():
    assert padded_vocab_size(257, 64, 1) == 320
    assert padded_vocab_size(257, 64, 4) == 512
    assert padded_vocab_size(256, 64, 2) == 256
