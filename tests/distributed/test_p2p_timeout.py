"""A pipeline receive never hangs: a stuck peer times out, a peer that goes away fails at once, each in one line."""

import pytest

from tests.harness.spawn import run_workers


def _wait_on_silent_peers(rank, world_size):
    """Rank 0 waits for a message from rank 2 (which leaves after 1.5 s) with a 30 s limit, then for one from rank 1
    (alive, silent) with a 1 s limit. In this order: a timed-out wait closes gloo's connections."""
    import time

    import torch
    import torch.distributed as dist

    from ppctl.pipeline.p2p import MessageWaitError, PipelineTransport
    from ppctl.pipeline.program import Message
    from ppctl.pipeline.stage import TensorSpec

    if rank == 1:
        try:  # silent and alive until rank 0 is done with it (its connections then close)
            dist.recv(torch.empty(1), 0)
        except RuntimeError:
            pass
        return None
    if rank == 2:
        time.sleep(1.5)
        dist.destroy_process_group()  # gone: its sockets close
        return None
    spec = TensorSpec((2, 4), torch.float32)
    outcomes = []
    for peer, timeout_s in ((2, 30.0), (1, 1.0)):
        transport = PipelineTransport(lambda pp_rank: pp_rank, lambda message: spec, "cpu", timeout_s=timeout_s)
        message = Message("act", src_stage=peer - 1, dst_stage=peer, microbatch=peer + 2, src_rank=peer, dst_rank=0)
        started = time.monotonic()
        transport.post([], [message])
        with pytest.raises(MessageWaitError) as failure:
            transport.take(message)
        outcomes.append((str(failure.value), time.monotonic() - started))
    return outcomes


@pytest.mark.timeout(90)
def test_receive_from_stuck_peer_times_out_and_from_gone_peer_fails():
    """A silent peer: one line naming this rank, the message, the peer and the limit, after the limit (not 60 s,
    the process group's). The peer's sockets closing: the wait ends at once, naming the message and peer."""
    (lost, lost_after), (timed_out, waited) = run_workers(_wait_on_silent_peers, 3, timeout=80)[0]
    assert timed_out.startswith("rank 0: no activation of microbatch 3 (stage 0->1) from rank 1 within 1 s"), timed_out
    assert "launcher.timeout_s" in timed_out and "\n" not in timed_out
    assert 0.9 <= waited < 5.0, waited
    assert lost.startswith("rank 0: receiving activation of microbatch 4 (stage 1->2) from rank 2 failed"), lost
    assert "Connection closed by peer" in lost, lost
    assert lost_after < 6.0, lost_after  # rank 2 leaves about 1.5 s after the wait began
