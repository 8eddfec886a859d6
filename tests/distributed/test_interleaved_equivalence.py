"""Interleaved 1F1B (virtual pipeline) trains exactly like one process.

Each rank holds vpp chunks placed by the looped layer map; per-step losses, grad norms,
step-0 gradients and final parameters are compared with the single-process run
(within the tolerances of ``tests/harness/tolerances.py``). One case uses a microbatch count that is
not a multiple of pp; rotary runs need positions on middle chunks, which read them as data.
"""

import pytest

from tests.distributed.equivalence import BASE, FP64, LLAMA, MASKED, assert_equivalent

ROPE_TIED = ["model.position_embedding=rope", "model.tie_embeddings=true"]

CASES = [  # (tp, pp, vpp, layers, global batch)
    (1, 2, 2, 4, 8),
    (1, 4, 2, 8, 8),
    (2, 2, 2, 4, 8),
    (1, 2, 2, 4, 6),
    (1, 1, 2, 4, 8),  # both chunks on one rank: every hand-over is local, in memory
]


@pytest.mark.nccl
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp, pp, vpp, layers, batch", CASES,
                         ids=[f"tp{t}-pp{p}-vpp{v}-gbs{b}" for t, p, v, _, b in CASES])
def test_interleaved_matches_single_process(tp, pp, vpp, layers, batch):
    layout = [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.vpp={vpp}", "parallel.dp=1",
              f"model.num_layers={layers}", "schedule=interleaved_1f1b", f"trainer.global_batch_size={batch}"]
    runs = [BASE + layout, BASE + layout + FP64]
    if batch == 8 and tp == 1:  # rotary positions reach the middle chunks; tied copies on two ranks or one
        runs.append(BASE + layout + ROPE_TIED + MASKED)
        runs.append(BASE + layout + LLAMA + FP64)
    assert_equivalent(runs, world_size=tp * pp)
