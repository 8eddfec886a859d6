"""Every layout and schedule trains exactly like one process on the same global batch.

One launch per layout trains GPipe and 1F1B in float32 (losses and parameters within
1e-5 relative) and 1F1B in float64 (every element within 1e-10); per-step losses and
the final parameters (each rank's TP shard) are compared with the plain
single-process loop of ``ppctl.reference``.
"""

import pytest

from tests.distributed.equivalence import BASE, FP64, assert_equivalent

LAYOUTS = [  # (tp, pp, dp)
    (1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (1, 4, 1),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp, pp, dp", LAYOUTS, ids=[f"tp{t}-pp{p}-dp{d}" for t, p, d in LAYOUTS])
def test_gpipe_and_1f1b_match_single_process(tp, pp, dp):
    layout = [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}"]
    runs = [BASE + layout + [f"schedule={name}"] for name in ("gpipe", "1f1b")]
    runs.append(BASE + layout + ["schedule=1f1b"] + FP64)
    assert_equivalent(runs, world_size=tp * pp * dp)


@pytest.mark.timeout(300)
def test_rotary_tied_embeddings_across_stages():
    # Tied word embeddings live on the first and last stage: their gradients meet over the embedding group.
    runs = [BASE + ["parallel.tp=2", "parallel.pp=2", "parallel.dp=1", "schedule=1f1b",
                    "model.position_embedding=rope", "model.tie_embeddings=true"]]
    assert_equivalent(runs, world_size=4)
