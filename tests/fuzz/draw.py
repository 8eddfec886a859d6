"""Drawing configurations at random from the whole space ppctl trains, for the composition fuzzer.

``draw(rng)`` picks every dimension on its own (tp, cp and its mode, sequence parallelism, dp, pp, the
schedule and its chunks, the distributed optimizer, recomputation, precision, tied embeddings, the model
family and positions, an uneven layout string or ``balance=auto``, a gradient delay with the schedules that
stream, a mixture of experts) within a world of at most ``MAX_WORLD`` CPU workers, and sizes the model and the batch so that most
draws are valid. What validation still refuses is the fuzzer's to count, not to avoid: ``drawn(seed, count)``
returns the valid draws and the refusals by rule. The same seed draws the same configurations.
"""

from __future__ import annotations

import random
from collections import Counter

from tests.distributed.equivalence import BASE

MAX_WORLD = 8
SCHEDULES = ("gpipe", "1f1b", "pipedream_flush", "pipedream_2bw", "interleaved_1f1b", "looped_bfs", "zb_h1",
             "interleaved_zb", "hanayo", "zbv", "v_half", "v_min", "dualpipe", "dualpipev")
V_SHAPED = ("zbv", "v_half", "v_min", "dualpipe", "dualpipev")  # two chunks per rank, placed by the schedule
INTERLEAVED = ("interleaved_1f1b", "looped_bfs", "interleaved_zb")  # any vpp
CP_MODES = ("allgather", "ring", "a2a")


def _parallel(rng: random.Random) -> dict[str, int]:
    """tp, cp, dp, pp with a world of at most ``MAX_WORLD``."""
    while True:
        sizes = {"tp": rng.choice((1, 1, 2, 4)), "cp": rng.choice((1, 1, 2)), "dp": rng.choice((1, 1, 2)),
                 "pp": rng.choice((1, 2, 2, 4))}
        if sizes["tp"] * sizes["cp"] * sizes["dp"] * sizes["pp"] <= MAX_WORLD:
            return sizes


def _schedule(rng: random.Random, pp: int) -> tuple[str, list[str], int]:
    """A schedule for ``pp`` ranks, its overrides and the stages per model copy it places."""
    if pp == 1:
        return "1f1b", [], 1
    name = rng.choice(SCHEDULES)
    if name in V_SHAPED:
        return name, [], pp * 2 // (2 if name == "dualpipe" else 1)
    if name == "hanayo":
        waves = rng.choice((1, 2))
        return name, [f"parallel.waves={waves}"], pp * 2 * waves
    if name in INTERLEAVED:
        vpp = rng.choice((2, 2, 3))
        return name, [f"parallel.vpp={vpp}"], pp * vpp
    return name, [], pp


def _model(rng: random.Random, tp: int, cp: int, cp_mode: str) -> list[str]:
    """The family, positions, heads and tying; heads divide over tp (and tp * cp for a2a attention)."""
    heads = 8 if tp * (cp if cp_mode == "a2a" else 1) > 4 else 4
    overrides = [f"model.num_heads={heads}", f"model.hidden_size={heads * 8}", f"model.ffn_hidden_size={heads * 16}"]
    if rng.random() < 0.4:
        kv = max(tp, heads // 2)
        overrides += ["model.family=llama", "model.position_embedding=rope", f"model.num_kv_heads={kv}"]
        if rng.random() < 0.3:
            overrides.append("model.qkv_bias=true")
    else:
        overrides.append(f"model.position_embedding={rng.choice(('learned', 'rope'))}")
        if rng.random() < 0.3:
            overrides.append("model.activation=gelu_tanh")
    if rng.random() < 0.3:
        overrides.append("model.tie_embeddings=true")
    if rng.random() < 0.25:
        overrides += _experts(rng)
    return overrides


def _experts(rng: random.Random) -> list[str]:
    """A mixture of experts: how many, top-k, the router, its losses or bias, shared experts, dense layers first,
    a capacity (refused beside tp or cp, and counted; ``_expert_parallel`` splits the experts)."""
    experts = rng.choice((2, 4))
    overrides = [f"model.moe.num_experts={experts}", f"model.moe.topk={rng.choice((1, 2))}",
                 f"model.moe.router_score={rng.choice(('softmax', 'sigmoid'))}",
                 f"model.moe.router_topk_norm={str(rng.random() < 0.5).lower()}",
                 f"model.moe.aux_loss_coeff={rng.choice((0.0, 0.01))}", f"model.moe.z_loss_coeff={rng.choice((0.0, 1e-3))}"]
    if rng.random() < 0.3:
        overrides.append("model.moe.expert_bias=true")
    if rng.random() < 0.3:
        overrides.append("model.moe.shared_experts=1")
    if rng.random() < 0.3:
        overrides.append("model.moe.first_dense_layers=1")
    if rng.random() < 0.2:
        overrides += ["model.moe.capacity_factor=1.0", f"model.moe.drop_policy={rng.choice(('probs', 'position'))}"]
    return overrides


def _split(rng: random.Random, stages: int, layers: int) -> list[str]:
    """The even split, ``balance=auto``, or a random layout string of ``layers`` over ``stages``."""
    choice = rng.random()
    if choice < 0.6 or stages == 1:
        return []
    if choice < 0.8:
        return ["parallel.balance=auto"]
    cuts = sorted(rng.sample(range(1, layers), stages - 1)) if layers > stages else list(range(1, stages))
    counts = [end - start for start, end in zip([0, *cuts], [*cuts, layers])]
    return ["parallel.pipeline_layout=E" + "|".join("t" * count for count in counts) + "L"]


def draw(rng: random.Random) -> list[str]:
    """One configuration: the equivalence harness's base and every dimension drawn."""
    sizes = _parallel(rng)
    tp, cp, dp, pp = sizes["tp"], sizes["cp"], sizes["dp"], sizes["pp"]
    name, schedule, stages = _schedule(rng, pp)
    cp_mode = rng.choice(CP_MODES)
    layers = stages * rng.choice((1, 2)) if stages > 1 else rng.choice((2, 3))
    microbatches = max(2 * pp, 4) * rng.choice((1, 2))  # DualPipe needs 2 pp of them, and even
    overrides = [*BASE, f"parallel.tp={tp}", f"parallel.cp={cp}", f"parallel.dp={dp}", f"parallel.pp={pp}",
                 f"schedule={name}", *schedule, f"model.num_layers={layers}",
                 f"trainer.global_batch_size={microbatches * dp}", f"trainer.seq_length={16 * max(cp, 1)}",
                 f"trainer.precision={rng.choice(('fp64', 'fp64', 'fp32'))}", *_model(rng, tp, cp, cp_mode)]
    if cp > 1:
        overrides.append(f"parallel.cp_comm={cp_mode}")
    if tp > 1 and (rng.random() < 0.5 or any(item.startswith("model.moe.") for item in overrides)):
        overrides.append("parallel.sequence_parallel=true")  # experts at tp > 1 need it
    if dp * cp > 1 and rng.random() < 0.5:
        overrides.append("optimizer.distributed=true")
    overrides.append(f"model.recompute={rng.choice(('none', 'none', 'full', 'selective'))}")
    if name == "pipedream_2bw" or (rng.random() < 0.1 and name not in V_SHAPED):
        overrides += ["optimizer.gradient_delay=1", "optimizer.clip_grad=0"]
    return overrides + _split(rng, stages, layers) + _expert_parallel(rng, overrides, tp, cp, dp, name)


# schedules whose pairs or weight fills parallel.overlap_ep_comm interleaves
OVERLAPPING = ("dualpipe", "dualpipev", "zb_h1", "zbv", "interleaved_zb", "v_half", "v_min")


def _expert_parallel(rng: random.Random, overrides: list[str], tp: int, cp: int, dp: int, schedule: str) -> list[str]:
    """With experts and more than one rank per pipeline stage, often an ep dividing both a stage's tp * cp * dp ranks
    and the experts; under DualPipe's pairs or a split backward (weight fills), sometimes interleaved."""
    experts = next((int(item.split("=")[1]) for item in overrides if item.startswith("model.moe.num_experts=")), 0)
    stage = tp * cp * dp
    choices = [ep for ep in range(2, stage + 1) if experts and stage % ep == 0 and experts % ep == 0]
    if not choices or rng.random() < 0.3:
        return []
    drawn = [f"parallel.ep={rng.choice(choices)}"]
    if schedule in OVERLAPPING and rng.random() < 0.5:
        drawn.append("parallel.overlap_ep_comm=true")
    return drawn


def drawn(seed: int, count: int, world: int | None = None) -> tuple[list[list[str]], Counter]:
    """``count`` configurations that validation accepts, drawn from ``seed``, and the refused ones by rule; ``world``:
    only draws of that many workers are kept (the others are passed over, not counted)."""
    from ppctl.config import ConfigError
    from ppctl.resolve import compose_config
    from ppctl.resolve.resolved import resolve

    rng, valid, refused = random.Random(seed), [], Counter()
    while len(valid) < count:
        overrides = draw(rng)
        if world is not None and world_size(overrides) != world:
            continue
        try:
            resolve(compose_config(overrides))
        except ConfigError as error:
            refused[str(error).split("=", 1)[0].split(":", 1)[0].strip()] += 1
            continue
        valid.append(overrides)
    return valid, refused


def world_size(overrides: list[str]) -> int:
    """The workers a drawn configuration runs on."""
    sizes = {key: int(value) for key, value in (item.split("=", 1) for item in overrides)
             if key in ("parallel.tp", "parallel.cp", "parallel.dp", "parallel.pp")}
    return sizes["parallel.tp"] * sizes["parallel.cp"] * sizes["parallel.dp"] * sizes["parallel.pp"]
